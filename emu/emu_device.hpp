// The emulated devices: sapwood::gpu::Device on host memory under the fiber scheduler
// (fiber.hpp). emu/metal_device.cpp runs the unmodified metal/*.metal kernels; emu/sycl_device.cpp
// runs the sycl/*.hpp twins behind the same kernel names and argument order. Declared here so
// that code outside the emulator's translation units never sees metal_shim.hpp's macros.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/device.h"

namespace sapwood::gpu {

std::unique_ptr<Device> make_emulated_metal_device();

// Every kernel the emulated device knows, with its binding signature: one letter per kernel
// parameter, in order. b: [[buffer(i)]] (i counts the b's before it), t: [[threadgroup(i)]],
// g: threadgroup_position_in_grid, i: thread_index_in_threadgroup, l: thread_index_in_simdgroup,
// s: simdgroup_index_in_threadgroup, n: simdgroups_per_threadgroup. (Tests compare these with
// the .metal sources.)
std::vector<std::pair<std::string, std::string>> emulated_metal_kernels();

std::unique_ptr<Device> make_emulated_sycl_device();

// The emulated SYCL device's kernels: name -> one 'b' per Metal buffer, one 't' per
// [[threadgroup]] argument (the built-ins have no counterpart to bind).
std::vector<std::pair<std::string, std::string>> emulated_sycl_kernels();

}  // namespace sapwood::gpu

// The real Metal device (metal/metal_device.mm, macOS only): sapwood::gpu::Device over
// MTLDevice / MTLLibrary / MTLComputePipelineState, built into _core by the guarded section of
// CMakeLists.txt (SAPWOOD_HAS_METAL).
#pragma once
#include <memory>

#include "gpu/device.h"

namespace sapwood::gpu {

bool metal_device_present();               // a Metal GPU and sapwood.metallib are there
std::unique_ptr<Device> make_metal_device();  // throws std::runtime_error saying what is missing

}  // namespace sapwood::gpu

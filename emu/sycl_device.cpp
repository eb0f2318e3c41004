// The emulated SYCL device: sapwood::gpu::Device (csrc/gpu/device.h) on host memory, named
// "sycl-emulated". Its pipelines are the Metal kernel names with the Metal argument order and
// launch shape (sycl/sycl_ops.hpp binds them into the sycl/*.hpp kernel templates); each
// dispatch runs the kernel with the emulated nd_item (sycl_emu.hpp) on the fiber runner, so
// the GPU backend's code runs unchanged over SYCL kernels. dispatch() runs the grid at once;
// wait() has nothing to wait for.
//
// Built with the emulator's flags (CMakeLists.txt: -fsigned-char -ffp-contract=off), in its own
// object library like emu/metal_device.cpp.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "emu_device.hpp"
#include "sycl_ops.hpp"

namespace {

// The emulator's launcher for sycl_ops.hpp: a 1-D grid of work-groups on the fiber runner.
struct EmuLauncher {
  template <class Body> void launch(size_t groups, int threads, size_t local_bytes, Body body) {
    if (groups > 0xffffffffu) throw std::runtime_error("sycl-emulated: " + std::to_string(groups) + " work-groups");
    const uint32_t g[3] = {uint32_t(groups), 1, 1};
    swemu::runner().launch(g, threads, local_bytes, [&](const swemu::ThreadCtx& c) {
      body(swemu::NdItem{&c}, reinterpret_cast<int8_t*>(c.smem));
    });
  }
};
using Op = swsycl::Op<EmuLauncher>;

class EmulatedSycl final : public sapwood::gpu::Device {
 public:
  std::string name() const override { return "sycl-emulated"; }

  sapwood::gpu::Buffer alloc(size_t bytes) override {
    const size_t n = (bytes + 63) / 64 * 64 + 64;  // never 0; room past the end, as the Metal device
    void* p = std::aligned_alloc(64, n);
    if (!p) throw std::runtime_error("sycl-emulated: cannot allocate " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, n);
    return sapwood::gpu::Buffer{p, p, bytes};
  }
  void release(sapwood::gpu::Buffer& b) override {
    std::free(b.handle);
    b = sapwood::gpu::Buffer{};
  }

  const void* pipeline(const std::string& kernel) override {
    if (const Op* op = swsycl::find_op<EmuLauncher>(kernel)) return op;
    throw std::runtime_error("sycl-emulated: no kernel named '" + kernel + "' (sycl/sycl_ops.hpp)");
  }

  void dispatch(const void* pipeline, const std::vector<sapwood::gpu::Arg>& args,
                const sapwood::gpu::Launch& l) override {
    const Op& op = *static_cast<const Op*>(pipeline);
    try {  // on this thread's fiber runner (fiber.hpp runner())
      EmuLauncher run;
      swsycl::dispatch(run, op, args, l, max_threads(pipeline));
    } catch (const swemu::Error& e) {
      throw std::runtime_error(std::string(op.name) + ": " + e.what());
    }
  }

  void wait() override {}
  int max_threads(const void*) override { return swemu::Runner::kMaxThreads; }
};

}  // namespace

namespace sapwood::gpu {

std::unique_ptr<Device> make_emulated_sycl_device() { return std::make_unique<EmulatedSycl>(); }

std::vector<std::pair<std::string, std::string>> emulated_sycl_kernels() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Op& op : swsycl::ops<EmuLauncher>())
    out.emplace_back(op.name, std::string(size_t(op.nbuf), 'b') + std::string(size_t(op.nlocal), 't'));
  return out;
}

}  // namespace sapwood::gpu

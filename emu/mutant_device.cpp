// A mutant of an emulated device, for tests/test_gpu_mutants.py: the emulated Metal device
// (metal_device.cpp), or with -DSW_SYCL_EMU the emulated SYCL device (sycl_device.cpp), built
// by tests/mutant_device.py around an edited kernel source and loaded with ctypes. _core's own
// devices are built once from the unedited sources, so a kernel with a barrier or a reduction
// deleted can only run through a second build like this one; its one entry dispatches as
// _core.gpu_run does (same registry, same binding, same checks). Buffers are the caller's host
// arrays themselves (the emulated device computes in host memory).
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <vector>

#include "emu_device.hpp"

#define SW_API extern "C" __attribute__((visibility("default")))

namespace {
char g_error[1024];
}

// The message of the last failed sw_device_run.
SW_API const char* sw_last_error() { return g_error; }

// args: nargs pointers with their sizes; is_block[i] marks a constant block (bytes) rather than
// a buffer. groups[3], threads, ntg threadgroup sizes. Returns 0, or -1 with sw_last_error().
SW_API int sw_device_run(const char* kernel, int nargs, void* const* ptrs, const size_t* sizes, const int* is_block,
                         const uint32_t* groups, int threads, int ntg, const size_t* tg_bytes) {
  try {
#if defined(SW_SYCL_EMU)
    static std::unique_ptr<sapwood::gpu::Device> dev = sapwood::gpu::make_emulated_sycl_device();
#else
    static std::unique_ptr<sapwood::gpu::Device> dev = sapwood::gpu::make_emulated_metal_device();
#endif
    std::vector<sapwood::gpu::Buffer> bufs(static_cast<size_t>(nargs));
    std::vector<sapwood::gpu::Arg> args;
    for (int i = 0; i < nargs; ++i) {
      bufs[size_t(i)] = sapwood::gpu::Buffer{nullptr, ptrs[i], sizes[i]};
      args.push_back(is_block[i] ? sapwood::gpu::Arg{nullptr, 0, ptrs[i], sizes[i]}
                                 : sapwood::gpu::Arg::of(bufs[size_t(i)]));
    }
    sapwood::gpu::Launch l;
    for (int d = 0; d < 3; ++d) l.groups[d] = groups[d];
    l.threads = threads;
    l.threadgroup_bytes.assign(tg_bytes, tg_bytes + ntg);
    dev->dispatch(dev->pipeline(kernel), args, l);
    dev->wait();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(g_error, sizeof g_error, "%s", e.what());
    return -1;
  }
}

#if defined(SW_SYCL_EMU)
#include "sycl_device.cpp"
#else
#include "metal_device.cpp"
#endif

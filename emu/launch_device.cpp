// The emulated Metal device (metal_device.cpp), or with -DSW_SYCL_EMU the emulated SYCL device
// (sycl_device.cpp), as a ctypes entry, for the mutation tests of tests/test_gpu_ops.py and
// tests/test_gpu_sycl.py: tests/gpu_util.py builds it like the per-family launchers, with an
// edited kernel source found first, and drives it through the same calls as _core.gpu_run.
// Buffers are the caller's host arrays themselves (the emulated device computes in host memory).
#include <string>
#include <vector>

#include "api.hpp"
#include "emu_device.hpp"

// args: nargs pointers with their sizes; is_block[i] marks a constant block (bytes) rather than
// a buffer. groups[3], threads, ntg threadgroup sizes.
SW_API int sw_device_run(const char* kernel, int nargs, void* const* ptrs, const size_t* sizes, const int* is_block,
                         const uint32_t* groups, int threads, int ntg, const size_t* tg_bytes) {
  return swemu::guard([&] {
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
  });
}

#if defined(SW_SYCL_EMU)
#include "sycl_device.cpp"
#else
#include "metal_device.cpp"
#endif

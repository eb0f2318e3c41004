// The real SYCL device: sapwood::gpu::Device (csrc/gpu/device.h) on a SYCL 2020 queue, named
// "sycl". The twin of emu/sycl_device.cpp: the same op table (sycl_ops.hpp: Metal kernel names,
// Metal argument order and launch shape) with a launcher that submits to the queue instead of
// the fiber runner.
//
// - one in-order queue on the default GPU, so dispatches run in encoding order with no events;
// - buffers are USM shared allocations: Buffer::host is the device pointer itself, valid on the
//   host at every sync point (device.h's contract);
// - dispatch() submits and returns; wait() is queue.wait_and_throw(), the one sync point;
// - every kernel requires sub-groups of 32 (sycl/README.md "Sub-groups and the canonical order").
//
// Built only where CMake finds a SYCL compiler (icpx -fsycl, or acpp), into its own library that
// _core loads at run time (csrc/bindings_gpu.cpp), so a missing SYCL runtime never stops `import
// sapwood`. Written against the SYCL 2020 specification and type-checked here with g++
// -fsyntax-only against the intel-sycl-rt headers (tests/test_gpu_sources.py); never compiled by
// a SYCL compiler nor run on a device in this project's CI.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <sycl/sycl.hpp>

#include "sycl_ops.hpp"

namespace {

namespace gpu = sapwood::gpu;

// sycl_ops.hpp's launcher on a queue: a 1-D nd_range of `groups` work-groups of `threads`
// items, `local_bytes` of local memory (16-byte aligned elements) handed to the body as bytes.
struct QueueLauncher {
  sycl::queue* q;
  template <class Body> void launch(size_t groups, int threads, size_t local_bytes, Body body) {
    const size_t local = size_t(threads);
    q->submit([&](sycl::handler& h) {
      sycl::local_accessor<sycl::int4, 1> lm(sycl::range<1>(local_bytes / 16 + 1), h);
      h.parallel_for(sycl::nd_range<1>(sycl::range<1>(groups * local), sycl::range<1>(local)),
                     [=](sycl::nd_item<1> it) [[sycl::reqd_sub_group_size(32)]] {
                       body(it, reinterpret_cast<int8_t*>(lm.get_multi_ptr<sycl::access::decorated::no>().get()));
                     });
    });
  }
};
using Op = swsycl::Op<QueueLauncher>;

class SyclDevice final : public gpu::Device {
 public:
  SyclDevice()
      : q_(sycl::gpu_selector_v, [this](sycl::exception_list errors) { keep(errors); },
           sycl::property_list{sycl::property::queue::in_order()}) {
    const sycl::device d = q_.get_device();
    const auto sizes = d.get_info<sycl::info::device::sub_group_sizes>();
    if (std::find(sizes.begin(), sizes.end(), size_t(swsycl::kSimd)) == sizes.end())
      throw std::runtime_error("sycl: " + d.get_info<sycl::info::device::name>() +
                               " offers no sub-groups of 32, which every sapwood kernel requires");
    max_threads_ = int(std::min<size_t>(1024, d.get_info<sycl::info::device::max_work_group_size>()));
  }
  ~SyclDevice() override {
    try {
      q_.wait();
    } catch (...) {  // a destructor must not throw; the error was the last wait()'s to report
    }
  }

  std::string name() const override { return "sycl"; }

  gpu::Buffer alloc(size_t bytes) override {
    const size_t n = (bytes + 63) / 64 * 64 + 64;  // never 0; room past the end, as the emulators
    void* p = sycl::malloc_shared(n, q_);
    if (!p) throw std::runtime_error("sycl: cannot allocate " + std::to_string(bytes) + " bytes of shared memory");
    std::memset(p, 0, n);  // shared memory is host-accessible; nothing of the queue uses it yet
    return gpu::Buffer{p, p, bytes};
  }
  void release(gpu::Buffer& b) override {
    if (b.handle) sycl::free(b.handle, q_);
    b = gpu::Buffer{};
  }

  const void* pipeline(const std::string& kernel) override {
    if (const Op* op = swsycl::find_op<QueueLauncher>(kernel)) return op;
    throw std::runtime_error("sycl: no kernel named '" + kernel + "' (sycl/sycl_ops.hpp)");
  }

  void dispatch(const void* pipeline, const std::vector<gpu::Arg>& args, const gpu::Launch& l) override {
    QueueLauncher run{&q_};
    try {
      swsycl::dispatch(run, *static_cast<const Op*>(pipeline), args, l, max_threads_);
    } catch (const sycl::exception& e) {
      throw std::runtime_error(std::string(static_cast<const Op*>(pipeline)->name) + ": " + e.what());
    }
  }

  void wait() override {
    q_.wait_and_throw();
    if (!error_.empty()) {
      std::string e;
      e.swap(error_);
      throw std::runtime_error("sycl: " + e);
    }
  }

  int max_threads(const void*) override { return max_threads_; }

 private:
  void keep(const sycl::exception_list& errors) {  // asynchronous errors, reported by wait()
    for (const std::exception_ptr& e : errors) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        if (error_.empty()) error_ = x.what();
      }
    }
  }

  std::string error_;
  sycl::queue q_;
  int max_threads_ = 0;
};

}  // namespace

// The entry points _core finds with dlsym (csrc/bindings_gpu.cpp): no exception crosses them.
extern "C" __attribute__((visibility("default"))) int sapwood_sycl_device_present() {
  try {
    return sycl::device(sycl::gpu_selector_v).is_gpu() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

extern "C" __attribute__((visibility("default"))) gpu::Device* sapwood_make_sycl_device(char* error, size_t n) {
  try {
    return new SyclDevice();
  } catch (const std::exception& e) {
    std::snprintf(error, n, "%s", e.what());
  } catch (...) {
    std::snprintf(error, n, "unknown error creating the SYCL device");
  }
  return nullptr;
}

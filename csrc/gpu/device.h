// The device layer of a GPU backend (docs/design.md "Backends"): the few calls through which the
// shared backend code (planning, layouts, argument binding, op order, state) reaches a device.
// Each GPU API implements it twice: the real API (Metal on macOS, a SYCL queue with icpx/acpp)
// and the kernel emulator (emu/), which runs the same kernel sources on the CPU, so the shared
// code above this layer is what CI runs.
//
// Memory is shared with the host (MTLStorageModeShared on Apple silicon, USM shared
// allocations in SYCL, host memory in the emulator): a buffer's `host` pointer is valid at
// every sync point, and nothing reads it between dispatches and wait().
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sapwood::gpu {

struct Buffer {
  void* handle = nullptr;  // the API's object (id<MTLBuffer>, a USM pointer, a host block)
  void* host = nullptr;    // the same memory seen by the host
  size_t bytes = 0;
};

// One kernel argument, bound to [[buffer(i)]] (Metal) / the i-th argument (SYCL) in order:
// a buffer at a byte offset, or a small constant block copied at encoding time (setBytes).
struct Arg {
  const Buffer* buf = nullptr;
  size_t offset = 0;
  const void* bytes = nullptr;  // used when buf is null
  size_t size = 0;
  static Arg of(const Buffer& b, size_t offset = 0) { return Arg{&b, offset, nullptr, 0}; }
  template <class T> static Arg value(const T& v) { return Arg{nullptr, 0, &v, sizeof(T)}; }
};

struct Launch {
  uint32_t groups[3] = {1, 1, 1};  // threadgroups in the grid
  int threads = 32;                // threads per threadgroup, a multiple of 32
  // bytes of each [[threadgroup(i)]] argument, in order (Metal: setThreadgroupMemoryLength)
  std::vector<size_t> threadgroup_bytes;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;
  virtual Buffer alloc(size_t bytes) = 0;  // zero-filled
  virtual void release(Buffer& b) = 0;
  // The compute pipeline of a kernel by its function name (cached); throws when unknown.
  virtual const void* pipeline(const std::string& kernel) = 0;
  // Encode one dispatch into the current command buffer (no host round trip). Arguments are
  // copied at encoding time (constants) or referenced (buffers).
  virtual void dispatch(const void* pipeline, const std::vector<Arg>& args, const Launch& l) = 0;
  // Commit the command buffer and wait for it: the one sync point of a forward.
  virtual void wait() = 0;
  // The largest threadgroup a pipeline accepts (maxTotalThreadsPerThreadgroup).
  virtual int max_threads(const void* pipeline) = 0;
};

// The devices this build has ("metal", "metal-emulated", "sycl", "sycl-emulated"); make()
// throws a std::runtime_error naming what to install or rebuild for one that is absent.
std::vector<std::string> available_devices();
std::unique_ptr<Device> make_device(const std::string& name);

}  // namespace sapwood::gpu

// The GPU device layer's factory (csrc/gpu/device.h) and a test hook into it: _core.gpu_devices()
// names the devices this build has, _core.gpu_run() runs one kernel on one of them with numpy
// arrays as buffers, so the Python tests drive any kernel on any device present (the emulated
// Metal and SYCL devices everywhere, the real ones on a Mac / where a SYCL compiler built sapwood)
// against the numpy oracles.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

#include "../emu/emu_device.hpp"
#include "common.h"
#include "gpu/device.h"
#if defined(SAPWOOD_HAS_METAL)
#include "../metal/metal_device.h"
#endif
#if defined(SAPWOOD_HAS_SYCL)
#include <dlfcn.h>
#endif

namespace py = pybind11;

namespace sapwood::gpu {

#if defined(SAPWOOD_HAS_SYCL)
// The real SYCL device lives in libsapwood_sycl_device (built by the SYCL compiler, see
// sycl/sycl_device.cpp), loaded on first use so that `import sapwood` never needs the SYCL
// runtime: $SAPWOOD_SYCL_DEVICE_LIB, else next to this module, else the build tree's copy.
struct SyclLib {
  int (*present)() = nullptr;
  Device* (*make)(char*, size_t) = nullptr;
  std::string error;
};
const SyclLib& sycl_lib() {
  static const SyclLib lib = [] {
    SyclLib l;
    std::vector<std::string> paths;
    if (const char* e = std::getenv("SAPWOOD_SYCL_DEVICE_LIB")) paths.push_back(e);
    Dl_info self{};
    if (dladdr(reinterpret_cast<void*>(&available_devices), &self) && self.dli_fname) {
      const std::string me = self.dli_fname;
      paths.push_back(me.substr(0, me.rfind('/') + 1) + SAPWOOD_SYCL_DEVICE_NAME);
    }
    paths.push_back(SAPWOOD_SYCL_DEVICE_PATH);
    for (const std::string& path : paths) {
      void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) {
        l.error += std::string(l.error.empty() ? "" : "; ") + dlerror();
        continue;
      }
      l.present = reinterpret_cast<int (*)()>(dlsym(h, "sapwood_sycl_device_present"));
      l.make = reinterpret_cast<Device* (*)(char*, size_t)>(dlsym(h, "sapwood_make_sycl_device"));
      if (l.present && l.make) return l;
      l.error += "; " + path + " lacks the sapwood_*_sycl_device entry points";
    }
    return l;
  }();
  return lib;
}
#endif

std::vector<std::string> available_devices() {
  std::vector<std::string> out;
#if defined(SAPWOOD_HAS_METAL)
  if (metal_device_present()) out.push_back("metal");
#endif
#if defined(SAPWOOD_HAS_SYCL)
  if (sycl_lib().present && sycl_lib().present()) out.push_back("sycl");
#endif
  out.push_back("metal-emulated");
  out.push_back("sycl-emulated");
  return out;
}

std::unique_ptr<Device> make_device(const std::string& name) {
  if (name == "metal-emulated") return make_emulated_metal_device();
  if (name == "sycl-emulated") return make_emulated_sycl_device();
  if (name == "metal") {
#if defined(SAPWOOD_HAS_METAL)
    return make_metal_device();
#else
    throw std::runtime_error(
        "device 'metal' is not in this build: it needs macOS with the Xcode command-line tools "
        "(xcrun metal); reinstall there with `pip install .`");
#endif
  }
  if (name == "sycl") {
#if defined(SAPWOOD_HAS_SYCL)
    const SyclLib& lib = sycl_lib();
    if (!lib.make)
      throw std::runtime_error("device 'sycl': cannot load the SYCL device library (" + lib.error +
                               "); is the SYCL runtime (oneAPI's setvars.sh, or AdaptiveCpp) on the library path?");
    char error[512] = "";
    if (Device* d = lib.make(error, sizeof error)) return std::unique_ptr<Device>(d);
    throw std::runtime_error(std::string("device 'sycl': ") + error);
#else
    throw std::runtime_error(
        "device 'sycl' is not in this build: it needs a SYCL 2020 compiler (icpx from oneAPI, or "
        "AdaptiveCpp's acpp) on PATH at build time; reinstall with `pip install .` there");
#endif
  }
  std::string known;
  for (const std::string& d : available_devices()) known += (known.empty() ? "" : ", ") + d;
  throw std::runtime_error("unknown GPU device '" + name + "'; this build has: " + known);
}

}  // namespace sapwood::gpu

namespace {

using sapwood::InputError;
using sapwood::cat;
namespace gpu = sapwood::gpu;

// One device per name, alive across calls (a real device keeps its library and pipelines),
// with a lock that each call holds while it runs: gpu_run releases the GIL, and two threads'
// calls on one device raced on its pipeline cache and its one queue (wait() would wait for
// the other's work too). Calls are independent, so a second one waits its turn.
struct SharedDevice {
  std::unique_ptr<gpu::Device> dev;
  std::mutex run;
};

SharedDevice& device(const std::string& name) {
  static std::mutex m;
  static std::map<std::string, std::unique_ptr<SharedDevice>> devices;
  std::lock_guard<std::mutex> lock(m);
  auto& d = devices[name];
  if (!d) {
    try {
      d = std::make_unique<SharedDevice>();
      d->dev = gpu::make_device(name);
    } catch (const std::runtime_error& e) {
      devices.erase(name);
      throw InputError(e.what());
    }
  }
  return *d;
}

// Buffers of one call, released however the call ends.
struct Buffers {
  gpu::Device& dev;
  std::vector<gpu::Buffer> bufs;
  ~Buffers() {
    for (gpu::Buffer& b : bufs) dev.release(b);
  }
};

void gpu_run(const std::string& dev_name, const std::string& kernel, py::list args, std::vector<int64_t> groups,
             int threads, std::vector<int64_t> threadgroup_bytes) {
  SharedDevice& shared = device(dev_name);
  // taken without the GIL (a thread holding the GIL would stall the one running, which needs
  // it to return), and held until this call's buffers are released
  std::unique_lock<std::mutex> turn(shared.run, std::defer_lock);
  {
    py::gil_scoped_release release;
    turn.lock();
  }
  gpu::Device& dev = *shared.dev;
  SW_CHECK(!groups.empty() && groups.size() <= 3, kernel, ": groups must have 1 to 3 entries, got ", groups.size());
  gpu::Launch l;
  for (size_t i = 0; i < groups.size(); ++i) {
    SW_CHECK(groups[i] >= 0 && groups[i] <= INT32_MAX, kernel, ": groups[", i, "] = ", groups[i], " out of range");
    l.groups[i] = uint32_t(groups[i]);
  }
  l.threads = threads;
  for (size_t i = 0; i < threadgroup_bytes.size(); ++i) {
    SW_CHECK(threadgroup_bytes[i] >= 0, kernel, ": threadgroup_bytes[", i, "] = ", threadgroup_bytes[i], " < 0");
    l.threadgroup_bytes.push_back(size_t(threadgroup_bytes[i]));
  }
  Buffers held{dev, {}};
  held.bufs.reserve(args.size());
  std::vector<std::string> blocks;  // constant blocks (bytes objects)
  blocks.reserve(args.size());
  std::vector<py::array> arrays(args.size());
  std::vector<int> buf_of(args.size(), -1);
  for (size_t i = 0; i < args.size(); ++i) {
    py::handle a = args[i];
    if (py::isinstance<py::bytes>(a)) {
      blocks.push_back(a.cast<std::string>());
      SW_CHECK(!blocks.back().empty(), kernel, ": args[", i, "] is an empty constant block");
    } else if (py::isinstance<py::array>(a)) {
      bool again = false;  // the same array twice is one buffer bound twice (in-place ops)
      for (size_t j = 0; j < i && !again; ++j)
        if (buf_of[j] >= 0 && args[j].ptr() == a.ptr()) buf_of[i] = buf_of[j], again = true;
      if (again) continue;
      py::array arr = py::reinterpret_borrow<py::array>(a);
      SW_CHECK(arr.flags() & py::array::c_style, kernel, ": args[", i, "] must be C-contiguous");
      arrays[i] = arr;
      buf_of[i] = int(held.bufs.size());
      held.bufs.push_back(dev.alloc(size_t(arr.nbytes())));
      if (arr.nbytes()) std::memcpy(held.bufs.back().host, arr.data(), size_t(arr.nbytes()));
    } else {
      throw InputError(cat(kernel, ": args[", i, "] must be a numpy array (a buffer) or bytes (a constant "
                                   "block), got ", std::string(py::str(py::type::handle_of(a)))));
    }
  }
  std::vector<gpu::Arg> bound;
  for (size_t i = 0, c = 0; i < args.size(); ++i) {
    if (buf_of[i] >= 0) {
      bound.push_back(gpu::Arg::of(held.bufs[size_t(buf_of[i])]));
    } else {
      const std::string& b = blocks[c++];
      bound.push_back(gpu::Arg{nullptr, 0, b.data(), b.size()});
    }
  }
  {
    py::gil_scoped_release release;
    const void* p = dev.pipeline(kernel);
    dev.dispatch(p, bound, l);
    dev.wait();
  }
  for (size_t i = 0; i < args.size(); ++i)  // outputs come back in place; read-only arrays are inputs
    if (buf_of[i] >= 0 && arrays[i] && arrays[i].writeable() && arrays[i].nbytes())
      std::memcpy(arrays[i].mutable_data(), held.bufs[size_t(buf_of[i])].host, size_t(arrays[i].nbytes()));
}

}  // namespace

void bind_gpu(py::module_& m) {
  m.def("gpu_devices", &gpu::available_devices, "The GPU devices this build has (csrc/gpu/device.h).");
  m.def("gpu_run", &gpu_run, py::arg("device"), py::arg("kernel"), py::arg("args"), py::arg("groups"),
        py::arg("threads"), py::arg("threadgroup_bytes") = std::vector<int64_t>{},
        "Run one kernel: args[i] is [[buffer(i)]], a numpy array (copied to a device buffer and back, "
        "so outputs land in place; the same array object twice binds one buffer twice) or bytes (a constant block); groups are threadgroups per grid "
        "(1 to 3 dims), threads per threadgroup, threadgroup_bytes[i] sizes [[threadgroup(i)]]. "
        "Errors name the kernel.");
  m.def("gpu_emulated_kernels", [](const std::string& dev) {
    SW_CHECK(dev == "metal-emulated" || dev == "sycl-emulated", "gpu_emulated_kernels: device must be "
             "'metal-emulated' or 'sycl-emulated', got '", dev, "'");
    std::map<std::string, std::string> out;
    for (const auto& [name, kinds] : dev == "metal-emulated" ? gpu::emulated_metal_kernels() : gpu::emulated_sycl_kernels())
      out[name] = kinds;
    return out;
  }, py::arg("device") = "metal-emulated",
     "An emulated device's registry: kernel name -> one letter per parameter (b buffer, t threadgroup "
     "memory, g/i/l/s/n the position built-ins; the SYCL device lists its b and t only; emu/emu_device.hpp).");
}

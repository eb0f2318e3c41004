#include "backend.h"

#include "backend_cpu.h"
#include "common.h"
#include "gpu/gpu_backend.h"

namespace sapwood {

std::vector<std::string> available_backends() {
  std::vector<std::string> out{"cpu"};
  for (const std::string& d : gpu::available_devices()) out.push_back(d);
  return out;
}

std::unique_ptr<Backend> make_backend(const std::string& name, const ModelDims& d,
                                      const ModelWeights& w, KVDtype kv, int max_context,
                                      int page_size, int threads) {
  if (name == "cpu") return std::make_unique<CpuBackend>(d, w, kv, max_context, page_size, threads);
  std::string have;
  for (const std::string& b : available_backends()) {
    if (b == name) return std::make_unique<GpuBackend>(gpu::make_device(name), d, w, kv, max_context, page_size);
    have += (have.empty() ? "" : ", ") + b;
  }
  SW_CHECK(false, "backend '", name, "' is not in this build (it has: ", have, "); metal needs macOS "
           "with Xcode's command-line tools (xcrun metal) when sapwood is built, sycl a SYCL compiler "
           "(icpx or acpp) on PATH");
  return nullptr;
}

}  // namespace sapwood

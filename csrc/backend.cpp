#include "backend.h"

#include "backend_cpu.h"
#include "common.h"

namespace sapwood {

std::vector<std::string> available_backends() { return {"cpu"}; }

std::unique_ptr<Backend> make_backend(const std::string& name, const ModelDims& d,
                                      const ModelWeights& w, KVDtype kv, int max_context,
                                      int page_size, int threads) {
  if (name == "cpu") return std::make_unique<CpuBackend>(d, w, kv, max_context, page_size, threads);
  if (name == "metal" || name == "metal-emulated" || name == "sycl" || name == "sycl-emulated")
    SW_CHECK(false, "backend '", name, "' is not in this build (it has: cpu); metal needs macOS "
             "with Xcode's command-line tools (xcrun metal) at install time, sycl a SYCL compiler "
             "(icpx or acpp) on PATH: reinstall with `pip install --force-reinstall --no-binary "
             ":all: sapwood` there");
  SW_CHECK(false, "unknown backend '", name, "' (this build has: cpu)");
  return nullptr;
}

}  // namespace sapwood

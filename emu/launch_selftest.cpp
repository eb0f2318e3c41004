// Launch of selftest.metal (metal-emu only): one threadgroup of 64 threads.
#include "api.hpp"
#include "metal_shim.hpp"
#include "selftest.metal"

SW_API int sw_emu_selftest(const float* x, float* out) {
  return swemu::guard([&] {
    const uint32_t grid[3] = {1, 1, 1};
    swemu::runner().launch(grid, 64, 0, [&](const swemu::ThreadCtx& c) { emu_selftest(x, out, c.tid, c.lane); });
  });
}

// Emulated launches of the int8 KV quantize kernel (metal/kv_quant.metal or sycl/kv_quant.hpp,
// chosen by -DSW_METAL / -DSW_SYCL_EMU).
#include "api.hpp"
#if defined(SW_METAL)
#include "metal_shim.hpp"
#include "kv_quant.metal"
#else
#include "kv_quant.hpp"
#endif

using swemu::ThreadCtx;

// x [T, Hkv, D] -> q/s: pages [pages, Hkv, page_size, D] through page_table at positions
// pos0.., or direct rows [T, Hkv, D] when page_size == 0.
SW_API int sw_kv_quantize(const float* x, int8_t* q, float* s, const int32_t* page_table, int T, int Hkv,
                          int D, int page_size, int pos0) {
  return swemu::guard([&] {
    swemu::require(D % 32 == 0 && D <= 1024, "head_dim must be a multiple of 32, at most 1024");
    swemu::require(T > 0 && Hkv > 0, "empty launch");
#if defined(SW_METAL)
    const uint32_t grid[3] = {uint32_t(T), uint32_t(Hkv), 1};
    SwKVQuantParams p{T, Hkv, D, page_size, pos0};
    swemu::runner().launch(grid, D, 0, [&](const ThreadCtx& c) {
      kv_quantize(x, reinterpret_cast<char*>(q), s, page_table, p, uint3(c.tg[0], c.tg[1], c.tg[2]), c.tid, c.lane);
    });
#else
    const uint32_t grid[3] = {uint32_t(T * Hkv), 1, 1};
    const swsycl::KVQuantArgs a{x, q, s, page_table, T, Hkv, D, page_size, pos0};
    swemu::runner().launch(grid, D, 0, [&](const ThreadCtx& c) { swsycl::kv_quantize(swemu::NdItem{&c}, a); });
#endif
  });
}

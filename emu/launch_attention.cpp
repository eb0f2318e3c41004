// Emulated launches of tree attention (metal/tree_attention.metal or sycl/tree_attention.hpp).
// The planning (ancestor lists, row blocks, chunk and simdgroup counts) is the host backends'
// own (metal/sw_plan.h, sycl/sw_sycl_common.hpp), so the tests exercise it too.
#include "api.hpp"
#if defined(SW_METAL)
#include "metal_shim.hpp"
#include "tree_attention.metal"
#include "sw_plan.h"
using Plan = SwAttnPlan;
#define PLAN sw_attn_plan
#define BLOCK sw_attn_block
#define SMEM sw_attn_smem_bytes
constexpr int kMaxP = SW_ATTN_MAXP;
#else
#include "tree_attention.hpp"
using Plan = swsycl::AttnPlan;
#define PLAN swsycl::attn_plan
#define BLOCK swsycl::attn_block
#define SMEM swsycl::attn_local_bytes
constexpr int kMaxP = swsycl::kAttnMaxP;
#endif

using swemu::ThreadCtx;

// q [N, Hq, D]; history pages (int8 + scales) through page_table; the tree's own int8 keys and
// values [N, Hkv, D] (+ scales); parents [N] -> out [N, Hq, D].
SW_API int sw_tree_attention(const float* q, const int8_t* k_pages, const float* k_pscale, const int8_t* v_pages,
                             const float* v_pscale, const int32_t* page_table, const int8_t* k_tree,
                             const float* k_tscale, const int8_t* v_tree, const float* v_tscale,
                             const int32_t* parents, int N, int Hq, int Hkv, int D, int hist_len, int page_size,
                             int split, float* out) {
  return swemu::guard([&] {
    using swemu::require;
    require(N >= 1 && Hkv >= 1 && Hq % Hkv == 0, "heads");
    require(D % 32 == 0 && D <= 256, "head_dim must be a multiple of 32, at most 256");
    require(split > 0 && split % 32 == 0, "split must be a multiple of the 32-key tile");
    require(hist_len == 0 || (page_size > 0 && page_size % 32 == 0), "page_size must be a multiple of 32");
    require(Hq / Hkv <= 32 * kMaxP, "too many query heads per KV head");
    swemu::Buf<int32_t> depth(N), anc(size_t(N) * N), row_len(N);
    Plan plan;
    require(PLAN(parents, N, hist_len, Hq, Hkv, 32, depth.data(), anc.data(), row_len.data(), &plan) == 0, "parents");
    const float scale = 1.0f / __builtin_sqrtf(float(D));
    swemu::Buf<float> part;
    int nr = 0, n_chunks = 0, nsg = 0;
    for (int r0 = 0; r0 < N; r0 += nr) {
      BLOCK(plan, row_len.data(), r0, split, &nr, &n_chunks, &nsg);
      part.resize(size_t(n_chunks) * nr * Hq * (D + 2));
      const float* qb = q + size_t(r0) * Hq * D;
      const int32_t* ab = anc.data() + size_t(r0) * plan.stride;
      const int32_t* lb = row_len.data() + r0;
      float* ob = out + size_t(r0) * Hq * D;
#if defined(SW_METAL)
      SwAttnParams p{nr, Hq, Hkv, D, hist_len, page_size, split, n_chunks, plan.stride, scale};
      const uint32_t g1[3] = {uint32_t(n_chunks), uint32_t(Hkv), 1};
      swemu::runner().launch(g1, nsg * 32, SMEM(D), [&](const ThreadCtx& c) {
        tree_attn_partial(qb, (const char*)k_pages, k_pscale, (const char*)v_pages, v_pscale, page_table,
                          (const char*)k_tree, k_tscale, (const char*)v_tree, v_tscale, ab, lb, part.data(), p,
                          c.smem, uint3(c.tg[0], c.tg[1], c.tg[2]), c.tid, c.lane, c.sg, c.nsg);
      });
      const uint32_t g2[3] = {uint32_t(nr), uint32_t(Hq), 1};
      swemu::runner().launch(g2, 32, 0, [&](const ThreadCtx& c) {
        tree_attn_merge(part.data(), lb, ob, p, uint3(c.tg[0], c.tg[1], c.tg[2]), c.lane);
      });
#else
      const swsycl::AttnArgs a{qb, k_pages, v_pages, k_pscale, v_pscale, page_table, k_tree, v_tree, k_tscale,
                               v_tscale, ab, lb, part.data(), ob, nr, Hq, Hkv, D, hist_len, page_size, split,
                               n_chunks, plan.stride, scale};
      const uint32_t g1[3] = {uint32_t(n_chunks * Hkv), 1, 1};
      swemu::runner().launch(g1, nsg * 32, SMEM(D), [&](const ThreadCtx& c) {
        swsycl::tree_attn_partial(swemu::NdItem{&c}, a, reinterpret_cast<int8_t*>(c.smem));
      });
      const uint32_t g2[3] = {uint32_t(nr * Hq), 1, 1};
      swemu::runner().launch(g2, 32, 0, [&](const ThreadCtx& c) { swsycl::tree_attn_merge(swemu::NdItem{&c}, a); });
#endif
    }
  });
}

// Tree attention over int8 KV pages, split-K (docs/design.md "Tree attention", "Exactness").
//
// tree_attn_partial: one threadgroup per (chunk of `split` absolute positions, KV head). Every
// (tree row, query head of this KV head) pair is carried by one simdgroup; all pairs share each
// tile of 32 history keys, loaded once into threadgroup memory as int8 + scales. Tree keys (the
// row's ancestors and itself, at positions >= hist_len) differ per row and are read from the
// tree's own int8 buffer through the row's ancestor list.
//
// Queries are int8-roundtripped like a key (kv_quant.metal's rule, per 32 dims: lane l holds
// dim l of each group, so a group's amax is one simd_max): the CPU's int8-query scores
// (csrc/kernels/tree_attention_q8.inc) in float arithmetic, equal up to float rounding.
// Canonical order (fixed by positions and dims; never by N, the tree shape or nsg):
//   score(key) = simd_sum over lanes of [lane l: fma over dims d = l, l+32, ... in order of
//                q[d] * (float(k[d]) * kscale[d/32])], times scale;
//   per tile of 32 absolute positions: m_t = simd_max(lane j: score of key j), running max
//   m' = max(m, m_t), rescale (l, acc) by exp(m - m') when m' > m, l += simd_sum(lane j:
//   exp(s_j - m')), acc[d] += exp(s_j - m') * v_j[d] as fma in key order (lane owns d);
//   chunks merged in chunk order by tree_attn_merge.
// A key reaches the same arithmetic whether it sits in a page or in the tree buffer (same
// int8 and scale, same dequantization), so a node's output is the same in a tree, a chain, or
// alone after its ancestors were committed to pages.
#include <metal_stdlib>
#include "sw_common.h"
using namespace metal;

// Lane's share of q . k: dims lane, lane + 32, ...; k dequantized as float(int8) * its scale.
template <typename KP, typename SP>
inline float dot_part(thread const float* qr, KP k, SP ks, int dpl, uint lane) {
  float acc = 0.0f;
  for (int t = 0; t < dpl; ++t) acc = fma(qr[t], float(k[lane + SW_SIMD * t]) * ks[t], acc);
  return acc;
}

template <typename VP, typename SP>
inline void acc_add(thread float* acc, float pj, VP v, SP vs, int dpl, uint lane) {
  for (int t = 0; t < dpl; ++t) acc[t] = fma(pj, float(v[lane + SW_SIMD * t]) * vs[t], acc[t]);
}

kernel void tree_attn_partial(
    device const float* q           [[buffer(0)]],   // [N, Hq, D]
    device const char* k_pages      [[buffer(1)]],   // [pages, Hkv, page_size, D]
    device const float* k_pscale    [[buffer(2)]],   // [pages, Hkv, page_size, D/32]
    device const char* v_pages      [[buffer(3)]],
    device const float* v_pscale    [[buffer(4)]],
    device const int* page_table    [[buffer(5)]],
    device const char* k_tree       [[buffer(6)]],   // [N, Hkv, D]: tree nodes, int8
    device const float* k_tscale    [[buffer(7)]],   // [N, Hkv, D/32]
    device const char* v_tree       [[buffer(8)]],
    device const float* v_tscale    [[buffer(9)]],
    device const int* anc           [[buffer(10)]],  // [N, anc_stride]: node at depth j on row i's path
    device const int* row_len       [[buffer(11)]],  // [N]: keys row i sees = hist_len + depth + 1
    device float* part              [[buffer(12)]],  // [n_chunks, N, Hq, D + 2]: m, l, acc[D]
    constant SwAttnParams& p        [[buffer(13)]],
    threadgroup char* smem          SW_THREADGROUP_ARG(0),  // 72 * D bytes
    uint3 tg                        [[threadgroup_position_in_grid]],  // (chunk, KV head)
    uint tid                        [[thread_index_in_threadgroup]],
    uint lane                       [[thread_index_in_simdgroup]],
    uint sg                         [[simdgroup_index_in_threadgroup]],
    uint nsg                        [[simdgroups_per_threadgroup]])
{
  const int D = p.head_dim, G = D / SW_KV_GROUP, dpl = D / SW_SIMD;
  const int Hq = p.n_q_heads, Hkv = p.n_kv_heads, grp = Hq / Hkv;
  const int c = tg.x, kvh = tg.y, nthr = nsg * SW_SIMD, npairs = p.n_rows * grp;
  const int c0 = c * p.split;
  int max_len = 0;
  for (int i = 0; i < p.n_rows; ++i) max_len = max(max_len, row_len[i]);
  const int c1 = min(c0 + p.split, max_len);

  threadgroup char* tk = smem;                          // [32][D] int8 keys of the tile
  threadgroup char* tv = smem + SW_ATTN_TILE * D;       // [32][D] int8 values
  threadgroup float* tks = (threadgroup float*)(smem + 2 * SW_ATTN_TILE * D);  // [32][G]
  threadgroup float* tvs = tks + SW_ATTN_TILE * G;

  float m[SW_ATTN_MAXP], l[SW_ATTN_MAXP];
  float qr[SW_ATTN_MAXP][SW_MAX_HEAD_DIM / SW_SIMD], acc[SW_ATTN_MAXP][SW_MAX_HEAD_DIM / SW_SIMD];
  for (int pp = 0; pp < SW_ATTN_MAXP; ++pp) {
    m[pp] = SW_NEG_BIG;
    l[pp] = 0.0f;
    const int pair = pp * nsg + sg;
    const int i = min(pair / grp, p.n_rows - 1), h = kvh * grp + pair % grp;
    for (int t = 0; t < dpl; ++t) {
      acc[pp][t] = 0.0f;
      const float x = q[(i * Hq + h) * D + lane + SW_SIMD * t];
      const float qs = simd_max(abs(x)) / 127.0f;
      qr[pp][t] = qs == 0.0f ? 0.0f : clamp(rint(x / qs), -127.0f, 127.0f) * qs;
    }
  }

  for (int a = c0; a < c1; a += SW_ATTN_TILE) {
    const int b = min(a + SW_ATTN_TILE, c1);
    const int n_hist = max(0, min(b, p.hist_len) - a);
    if (n_hist > 0) {  // tiles never cross pages: page_size is a multiple of 32
      const size_t row0 = (size_t(page_table[a / p.page_size]) * Hkv + kvh) * p.page_size + a % p.page_size;
      device const char4* ksrc = (device const char4*)(k_pages + row0 * D);
      device const char4* vsrc = (device const char4*)(v_pages + row0 * D);
      for (int e = tid; e < n_hist * D / 4; e += nthr) {
        ((threadgroup char4*)tk)[e] = ksrc[e];
        ((threadgroup char4*)tv)[e] = vsrc[e];
      }
      for (int e = tid; e < n_hist * G; e += nthr) {
        tks[e] = k_pscale[row0 * G + e];
        tvs[e] = v_pscale[row0 * G + e];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tile loaded

    for (int pp = 0; pp < SW_ATTN_MAXP; ++pp) {  // uniform across the simdgroup's lanes
      const int pair = pp * nsg + sg;
      if (pair >= npairs) break;
      const int i = pair / grp;
      const int cnt = min(b, row_len[i]) - a;  // keys of this tile row i sees
      if (cnt <= 0) continue;
      const int hcnt = min(cnt, n_hist);
      device const int* path = anc + i * p.anc_stride;
      float s[SW_ATTN_TILE];
      float mine = SW_NEG_BIG;  // lane j keeps the score of key j
      for (int j = 0; j < cnt; ++j) {
        float part_dot;
        if (j < hcnt) {
          part_dot = dot_part(qr[pp], tk + j * D, tks + j * G, dpl, lane);
        } else {
          const size_t r = size_t(path[a + j - p.hist_len]) * Hkv + kvh;
          part_dot = dot_part(qr[pp], k_tree + r * D, k_tscale + r * G, dpl, lane);
        }
        s[j] = simd_sum(part_dot) * p.scale;
        if (int(lane) == j) mine = s[j];
      }
      const float m_new = max(m[pp], simd_max(mine));
      if (m_new > m[pp]) {
        const float alpha = exp(m[pp] - m_new);
        l[pp] *= alpha;
        for (int t = 0; t < dpl; ++t) acc[pp][t] *= alpha;
      }
      m[pp] = m_new;
      l[pp] += simd_sum(int(lane) < cnt ? exp(mine - m_new) : 0.0f);
      for (int j = 0; j < cnt; ++j) {
        const float pj = exp(s[j] - m_new);  // the same bits lane j contributed to l
        if (j < hcnt) {
          acc_add(acc[pp], pj, tv + j * D, tvs + j * G, dpl, lane);
        } else {
          const size_t r = size_t(path[a + j - p.hist_len]) * Hkv + kvh;
          acc_add(acc[pp], pj, v_tree + r * D, v_tscale + r * G, dpl, lane);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tile consumed before the next load
  }

  for (int pp = 0; pp < SW_ATTN_MAXP; ++pp) {
    const int pair = pp * nsg + sg;
    if (pair >= npairs) break;
    const int i = pair / grp, h = kvh * grp + pair % grp;
    if (row_len[i] <= c0) continue;  // chunk not owned by this row: the merge never reads it
    device float* out = part + ((size_t(c) * p.n_rows + i) * Hq + h) * (D + 2);
    if (lane == 0) {
      out[0] = m[pp];
      out[1] = l[pp];
    }
    for (int t = 0; t < dpl; ++t) out[2 + lane + SW_SIMD * t] = acc[pp][t];
  }
}

// One simdgroup per (row, query head): merge the row's own chunks in chunk order by
// log-sum-exp, then normalise. Lane owns dims lane, lane + 32, ...; no cross-lane reduction.
kernel void tree_attn_merge(
    device const float* part        [[buffer(0)]],   // [n_chunks, N, Hq, D + 2]
    device const int* row_len       [[buffer(1)]],   // [N]
    device float* out               [[buffer(2)]],   // [N, Hq, D]
    constant SwAttnParams& p        [[buffer(3)]],
    uint3 tg                        [[threadgroup_position_in_grid]],  // (row, query head)
    uint lane                       [[thread_index_in_simdgroup]])
{
  const int i = tg.x, h = tg.y, D = p.head_dim, dpl = D / SW_SIMD, Hq = p.n_q_heads;
  const int own = (row_len[i] + p.split - 1) / p.split;
  float m = SW_NEG_BIG, l = 0.0f, o[SW_MAX_HEAD_DIM / SW_SIMD];
  for (int t = 0; t < dpl; ++t) o[t] = 0.0f;
  for (int c = 0; c < own; ++c) {
    device const float* pt = part + ((size_t(c) * p.n_rows + i) * Hq + h) * (D + 2);
    const float m_new = max(m, pt[0]);
    const float wa = exp(m - m_new), wb = exp(pt[0] - m_new);
    l = l * wa + pt[1] * wb;
    for (int t = 0; t < dpl; ++t) o[t] = o[t] * wa + pt[2 + lane + SW_SIMD * t] * wb;
    m = m_new;
  }
  const float inv = 1.0f / l;
  for (int t = 0; t < dpl; ++t) out[(i * Hq + h) * D + lane + SW_SIMD * t] = o[t] * inv;
}

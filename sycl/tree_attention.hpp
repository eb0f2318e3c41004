// Tree attention over int8 KV pages, split-K: the SYCL twin of metal/tree_attention.metal,
// with the same int8-roundtripped queries and canonical order (see that file's header): per key, a lane-strided fma dot and
// a sub-group sum; per 32-position tile, a sub-group max and sum; acc by fma in key order with
// lane owning dims lane, lane + 32, ...; chunks merged in chunk order.
//
// tree_attn_partial: work-group g is (chunk g % n_chunks, KV head g / n_chunks). Its sub-groups
// carry the (row, query head) pairs; all share each history tile staged in local memory
// (int8 K | int8 V | K scales | V scales, 72 * D bytes).
#pragma once
#include "sw_sycl_common.hpp"

namespace swsycl {

template <class It>
void tree_attn_partial(const It& it, const AttnArgs& a, int8_t* smem) {
  const int D = a.head_dim, G = D / kKVGroup, dpl = D / kSimd;
  const int Hq = a.n_q_heads, Hkv = a.n_kv_heads, grp = Hq / Hkv;
  const int g = int(it.get_group(0)), c = g % a.n_chunks, kvh = g / a.n_chunks;
  const int tid = int(it.get_local_id(0)), nthr = int(it.get_local_range(0));
  const int lane = sg_lane(it), sg = sg_index(it), nsg = sg_count(it), npairs = a.n_rows * grp;
  const int c0 = c * a.split;
  int max_len = 0;
  for (int i = 0; i < a.n_rows; ++i) max_len = imax(max_len, a.row_len[i]);
  const int c1 = imin(c0 + a.split, max_len);

  int8_t* tk = smem;                                            // [32][D]
  int8_t* tv = smem + kAttnTile * D;                            // [32][D]
  float* tks = reinterpret_cast<float*>(smem + 2 * kAttnTile * D);  // [32][G]
  float* tvs = tks + kAttnTile * G;

  float m[kAttnMaxP], l[kAttnMaxP], qr[kAttnMaxP][kMaxHeadDim / kSimd], acc[kAttnMaxP][kMaxHeadDim / kSimd];
  for (int pp = 0; pp < kAttnMaxP; ++pp) {
    m[pp] = kNegBig;
    l[pp] = 0.0f;
    const int pair = pp * nsg + sg;
    const int i = imin(pair / grp, a.n_rows - 1), h = kvh * grp + pair % grp;
    for (int t = 0; t < dpl; ++t) {
      acc[pp][t] = 0.0f;
      const float x = a.q[(i * Hq + h) * D + lane + kSimd * t];
      const float qs = sg_max(it, fabs(x)) / 127.0f;
      qr[pp][t] = qs == 0.0f ? 0.0f : clampf(rint(x / qs), -127.0f, 127.0f) * qs;
    }
  }

  for (int t0 = c0; t0 < c1; t0 += kAttnTile) {
    const int b = imin(t0 + kAttnTile, c1);
    const int n_hist = imax(0, imin(b, a.hist_len) - t0);
    if (n_hist > 0) {  // tiles never cross pages: page_size is a multiple of 32
      const size_t row0 = (size_t(a.page_table[t0 / a.page_size]) * Hkv + kvh) * a.page_size + t0 % a.page_size;
      const int32_t* ksrc = reinterpret_cast<const int32_t*>(a.k_pages + row0 * D);
      const int32_t* vsrc = reinterpret_cast<const int32_t*>(a.v_pages + row0 * D);
      for (int e = tid; e < n_hist * D / 4; e += nthr) {
        reinterpret_cast<int32_t*>(tk)[e] = ksrc[e];
        reinterpret_cast<int32_t*>(tv)[e] = vsrc[e];
      }
      for (int e = tid; e < n_hist * G; e += nthr) {
        tks[e] = a.k_pscale[row0 * G + e];
        tvs[e] = a.v_pscale[row0 * G + e];
      }
    }
    barrier(it);  // tile loaded

    for (int pp = 0; pp < kAttnMaxP; ++pp) {  // uniform across the sub-group
      const int pair = pp * nsg + sg;
      if (pair >= npairs) break;
      const int i = pair / grp;
      const int cnt = imin(b, a.row_len[i]) - t0;
      if (cnt <= 0) continue;
      const int hcnt = imin(cnt, n_hist);
      const int32_t* path = a.anc + i * a.anc_stride;
      float s[kAttnTile];
      float mine = kNegBig;  // lane j keeps the score of key j
      for (int j = 0; j < cnt; ++j) {
        const int8_t* kp;
        const float* ksc;
        if (j < hcnt) {
          kp = tk + j * D, ksc = tks + j * G;
        } else {
          const size_t r = size_t(path[t0 + j - a.hist_len]) * Hkv + kvh;
          kp = a.k_tree + r * D, ksc = a.k_tscale + r * G;
        }
        float part = 0.0f;
        for (int t = 0; t < dpl; ++t) part = fma(qr[pp][t], float(kp[lane + kSimd * t]) * ksc[t], part);
        s[j] = sg_sum(it, part) * a.scale;
        if (lane == j) mine = s[j];
      }
      const float m_new = fmax(m[pp], sg_max(it, mine));
      if (m_new > m[pp]) {
        const float alpha = exp(m[pp] - m_new);
        l[pp] *= alpha;
        for (int t = 0; t < dpl; ++t) acc[pp][t] *= alpha;
      }
      m[pp] = m_new;
      l[pp] += sg_sum(it, lane < cnt ? exp(mine - m_new) : 0.0f);
      for (int j = 0; j < cnt; ++j) {
        const float pj = exp(s[j] - m_new);  // the same bits lane j contributed to l
        const int8_t* vp;
        const float* vsc;
        if (j < hcnt) {
          vp = tv + j * D, vsc = tvs + j * G;
        } else {
          const size_t r = size_t(path[t0 + j - a.hist_len]) * Hkv + kvh;
          vp = a.v_tree + r * D, vsc = a.v_tscale + r * G;
        }
        for (int t = 0; t < dpl; ++t) acc[pp][t] = fma(pj, float(vp[lane + kSimd * t]) * vsc[t], acc[pp][t]);
      }
    }
    barrier(it);  // tile consumed before the next load
  }

  for (int pp = 0; pp < kAttnMaxP; ++pp) {
    const int pair = pp * nsg + sg;
    if (pair >= npairs) break;
    const int i = pair / grp, h = kvh * grp + pair % grp;
    if (a.row_len[i] <= c0) continue;  // chunk not owned by this row
    float* out = a.part + ((size_t(c) * a.n_rows + i) * Hq + h) * (D + 2);
    if (lane == 0) {
      out[0] = m[pp];
      out[1] = l[pp];
    }
    for (int t = 0; t < dpl; ++t) out[2 + lane + kSimd * t] = acc[pp][t];
  }
}

// One sub-group (work-group of 32) per (row, query head): work-group g = row g / Hq, head g % Hq.
template <class It>
void tree_attn_merge(const It& it, const AttnArgs& a) {
  const int Hq = a.n_q_heads, g = int(it.get_group(0)), i = g / Hq, h = g % Hq;
  const int D = a.head_dim, dpl = D / kSimd, lane = sg_lane(it);
  const int own = (a.row_len[i] + a.split - 1) / a.split;
  float m = kNegBig, l = 0.0f, o[kMaxHeadDim / kSimd];
  for (int t = 0; t < dpl; ++t) o[t] = 0.0f;
  for (int c = 0; c < own; ++c) {
    const float* pt = a.part + ((size_t(c) * a.n_rows + i) * Hq + h) * (D + 2);
    const float m_new = fmax(m, pt[0]);
    const float wa = exp(m - m_new), wb = exp(pt[0] - m_new);
    l = l * wa + pt[1] * wb;
    for (int t = 0; t < dpl; ++t) o[t] = o[t] * wa + pt[2 + lane + kSimd * t] * wb;
    m = m_new;
  }
  const float inv = 1.0f / l;
  for (int t = 0; t < dpl; ++t) a.out[(i * Hq + h) * D + lane + kSimd * t] = o[t] * inv;
}

}  // namespace swsycl

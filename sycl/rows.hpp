// Row reductions, the SYCL twins of metal/rows.metal: RMSNorm and the drafting ops over rows of
// logits (argmax, log-sum-exp, top-k). One work-group per row; a row's result never depends on
// how many rows the launch has, nor (for the float sums) on its work-group size.
//
// Canonical orders (those of metal/rows.metal):
//   rms_norm        ss = sg_sum over lanes l of [fma chain of x[k]^2, k = l, l+32, ...]; every
//                   sub-group computes it in full; inv = 1 / sqrt(ss / dim + eps); out = (x * inv) * w.
//   logsumexp_rows  m = max (exact); kLseLanes = 256 partial sums, partial v adding exp(x[k] - m)
//                   for k = v, v+256, ... in order; lane l of sub-group 0 adds partials
//                   v = l, l+32, ..., l+224 in order, then sg_sum; result m + log(sum).
//   argmax_rows, top_k_rows: selections, exact in any order (ties go to the lower index).
#pragma once
#include "sw_sycl_common.hpp"

namespace swsycl {

constexpr int kLseLanes = 256, kTopKMax = 16;
constexpr int kNoIndex = 0x7fffffff;  // "no index yet", loses to every real one

struct RowsArgs {  // SwRowsParams' fields and each kernel's buffers
  const float* x;       // [rows, cols]
  const float* w;       // rms_norm: [cols]
  float* out;           // rms_norm: [rows, cols] (may alias x); logsumexp: [rows]; top_k: values [rows, k]
  int32_t* ids;         // argmax: [rows]; top_k: [rows, k]
  const int32_t* skip;  // top_k: [rows]
  int rows, cols, k;
  float eps;
};

template <class It> void rms_norm(const It& it, const RowsArgs& a) {
  const int dim = a.cols, r = int(it.get_group(0)), lane = sg_lane(it);
  const int tid = int(it.get_local_id(0)), nthr = int(it.get_local_range(0));
  const float* xr = a.x + size_t(r) * dim;
  float* o = a.out + size_t(r) * dim;
  float ss = 0.0f;
  for (int k = lane; k < dim; k += kSimd) ss = fma(xr[k], xr[k], ss);
  ss = sg_sum(it, ss);
  const float inv = 1.0f / sqrt(ss / float(dim) + a.eps);
  barrier(it);  // every sub-group has read x before out (may be x) changes
  for (int k = tid; k < dim; k += nthr) o[k] = xr[k] * inv * a.w[k];
}

// (v, i) beats (bv, bi): a real index, and a larger value or an equal one at a lower index.
inline bool beats(float v, int i, float bv, int bi) {
  return i != kNoIndex && (bi == kNoIndex || v > bv || (v == bv && i < bi));
}

// The work-group's best (v, i), in every item: a butterfly over the sub-group, then across
// sub-groups through local memory rv, ri [sub-groups].
template <class It>
inline void group_best(const It& it, float& v, int& i, float* rv, int* ri) {
  for (int m = kSimd / 2; m >= 1; m /= 2) {
    const float ov = sg_shuffle_xor(it, v, m);
    const int oi = sg_shuffle_xor(it, i, m);
    if (beats(ov, oi, v, i)) v = ov, i = oi;
  }
  if (sg_lane(it) == 0) rv[sg_index(it)] = v, ri[sg_index(it)] = i;
  barrier(it);
  for (int s = 0; s < sg_count(it); ++s)
    if (beats(rv[s], ri[s], v, i)) v = rv[s], i = ri[s];
  barrier(it);  // read before the next round's writes
}

// ids[r] = the first index of the largest non-NaN x[r][.]; 0 when there is none.
template <class It> void argmax_rows(const It& it, const RowsArgs& a, float* rv, int* ri) {
  const int r = int(it.get_group(0)), tid = int(it.get_local_id(0)), nthr = int(it.get_local_range(0));
  const float* xr = a.x + size_t(r) * a.cols;
  float bv = 0.0f;
  int bi = kNoIndex;
  for (int k = tid; k < a.cols; k += nthr) {  // ascending: a tie keeps the earlier
    const float v = xr[k];
    if (v == v && (bi == kNoIndex || v > bv)) bv = v, bi = k;
  }
  group_best(it, bv, bi, rv, ri);
  if (tid == 0) a.ids[r] = bi == kNoIndex ? 0 : bi;
}

// out[r] = max + log(sum exp(x - max)) of row r; part: local [kLseLanes] floats.
template <class It> void logsumexp_rows(const It& it, const RowsArgs& a, float* part) {
  const int n = a.cols, r = int(it.get_group(0)), lane = sg_lane(it), sg = sg_index(it);
  const int tid = int(it.get_local_id(0)), nthr = int(it.get_local_range(0));
  const float* xr = a.x + size_t(r) * n;
  float m = xr[0];
  for (int k = tid; k < n; k += nthr) m = fmax(m, xr[k]);
  m = sg_max(it, m);
  if (lane == 0) part[sg] = m;
  barrier(it);
  for (int s = 0; s < sg_count(it); ++s) m = fmax(m, part[s]);
  barrier(it);  // the maxima are read before the sums land
  for (int v = tid; v < kLseLanes; v += nthr) {
    float s = 0.0f;
    for (int k = v; k < n; k += kLseLanes) s += exp(xr[k] - m);
    part[v] = s;
  }
  barrier(it);
  if (sg == 0) {  // uniform across the sub-group
    float s = part[lane];
    for (int v = lane + kSimd; v < kLseLanes; v += kSimd) s += part[v];
    s = sg_sum(it, s);
    if (lane == 0) a.out[r] = m + log(s);
  }
}

// The k (<= 16) best ids of row r other than skip[r] (-1: none), best first, an equal value's
// lower id first, NaN never; ids [rows, k] (-1 where fewer qualify), values out [rows, k] (0
// there). Each item keeps its own best k of a strided pass; k rounds pick the group's best
// head and pop it from its item's list. rv, ri: local [sub-groups].
template <class It> void top_k_rows(const It& it, const RowsArgs& a, float* rv, int* ri) {
  const int r = int(it.get_group(0)), K = imin(a.k, kTopKMax), sk = a.skip[r];
  const int tid = int(it.get_local_id(0)), nthr = int(it.get_local_range(0));
  if (K <= 0) return;  // the whole group: no barrier is left half reached
  const float* xr = a.x + size_t(r) * a.cols;
  float lv[kTopKMax];
  int li[kTopKMax];
  int cnt = 0;
  for (int k = tid; k < a.cols; k += nthr) {  // ascending: an equal value stays behind
    const float v = xr[k];
    if (v != v || k == sk || (cnt == K && !(v > lv[K - 1]))) continue;
    int at = cnt < K ? cnt : K - 1;
    for (; at > 0 && lv[at - 1] < v; --at) lv[at] = lv[at - 1], li[at] = li[at - 1];
    lv[at] = v, li[at] = k;
    cnt = imin(cnt + 1, K);
  }
  int head = 0;
  for (int j = 0; j < K; ++j) {
    float bv = head < cnt ? lv[head] : 0.0f;
    int bi = head < cnt ? li[head] : kNoIndex;
    group_best(it, bv, bi, rv, ri);
    if (head < cnt && li[head] == bi) ++head;
    if (tid == 0) {
      a.ids[r * K + j] = bi == kNoIndex ? -1 : bi;
      a.out[r * K + j] = bi == kNoIndex ? 0.0f : bv;
    }
  }
}

}  // namespace swsycl

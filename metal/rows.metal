// Row reductions: RMSNorm, and the drafting ops over rows of logits (argmax, log-sum-exp,
// top-k). One threadgroup per row; a row's result never depends on how many rows the launch
// has, nor (for the float sums) on its thread count.
//
// Canonical orders:
//   rms_norm        ss = simd_sum over lanes l of [fma chain of x[k]^2, k = l, l+32, ... in
//                   order]; every simdgroup computes it in full (so nothing depends on the
//                   simdgroup count), inv = 1 / sqrt(ss / dim + eps), out = (x * inv) * w.
//   logsumexp_rows  m = max (exact in any order); SW_LSE_LANES = 256 partial sums, partial v
//                   adding exp(x[k] - m) for k = v, v+256, ... in order; partials folded as
//                   lane l of one simdgroup adding v = l, l+32, ..., l+224 in order, then
//                   simd_sum; result m + log(sum). Threads take partials v = tid, tid + threads,
//                   ..., so any thread count gives the same bits.
//   argmax_rows, top_k_rows: selections, exact in any order (ties go to the lower index).
#include <metal_stdlib>
#include "sw_common.h"
using namespace metal;

// x [rows, dim] -> out [rows, dim] (may alias x): x * rsqrt(mean(x^2) + eps) * w, w the scale as
// applied (callers pass 1 + w for the zero-centred norms).
kernel void rms_norm(device const float* x             [[buffer(0)]],
                     device const float* w             [[buffer(1)]],  // [dim]
                     device float* out                 [[buffer(2)]],
                     constant SwRowsParams& p          [[buffer(3)]],
                     uint3 tg                          [[threadgroup_position_in_grid]],
                     uint tid                          [[thread_index_in_threadgroup]],
                     uint lane                         [[thread_index_in_simdgroup]],
                     uint nsg                          [[simdgroups_per_threadgroup]])
{
  const int dim = p.cols;
  device const float* xr = x + size_t(tg.x) * dim;
  device float* o = out + size_t(tg.x) * dim;
  float ss = 0.0f;
  for (int k = lane; k < dim; k += SW_SIMD) ss = fma(xr[k], xr[k], ss);
  ss = simd_sum(ss);
  const float inv = 1.0f / sqrt(ss / float(dim) + p.eps);
  threadgroup_barrier(mem_flags::mem_device);  // every simdgroup has read x before out (may be x) changes
  for (int k = tid; k < dim; k += nsg * SW_SIMD) o[k] = xr[k] * inv * w[k];
}

// (v, i) beats (bv, bi): a real index, and a larger value or an equal one at a lower index.
// NaNs never get here (the callers skip them), so this is a strict total order.
inline bool beats(float v, int i, float bv, int bi) {
  return i != SW_NO_INDEX && (bi == SW_NO_INDEX || v > bv || (v == bv && i < bi));
}

// Butterfly over the simdgroup: every lane ends with the simdgroup's best (v, i).
inline void simd_best(thread float& v, thread int& i) {
  for (ushort m = 16; m >= 1; m /= 2) {
    const float ov = simd_shuffle_xor(v, m);
    const int oi = simd_shuffle_xor(i, m);
    if (beats(ov, oi, v, i)) v = ov, i = oi;
  }
}

// Across simdgroups through threadgroup memory; every thread returns with the group's best.
inline void group_best(thread float& v, thread int& i, threadgroup float* rv, threadgroup int* ri,
                       uint lane, uint sg, uint nsg) {
  simd_best(v, i);
  if (lane == 0) rv[sg] = v, ri[sg] = i;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = 0; s < nsg; ++s)
    if (beats(rv[s], ri[s], v, i)) v = rv[s], i = ri[s];
  threadgroup_barrier(mem_flags::mem_threadgroup);  // read before the next round's writes
}

// out[r] = the first index of the largest non-NaN x[r][.]; 0 when there is none.
kernel void argmax_rows(device const float* x          [[buffer(0)]],  // [rows, cols]
                        device int* out                [[buffer(1)]],  // [rows]
                        constant SwRowsParams& p       [[buffer(2)]],
                        threadgroup float* rv          SW_THREADGROUP_ARG(0),  // [nsg]
                        threadgroup int* ri            SW_THREADGROUP_ARG(1),  // [nsg]
                        uint3 tg                       [[threadgroup_position_in_grid]],
                        uint tid                       [[thread_index_in_threadgroup]],
                        uint lane                      [[thread_index_in_simdgroup]],
                        uint sg                        [[simdgroup_index_in_threadgroup]],
                        uint nsg                       [[simdgroups_per_threadgroup]])
{
  device const float* xr = x + size_t(tg.x) * p.cols;
  float bv = 0.0f;
  int bi = SW_NO_INDEX;
  for (int k = tid; k < p.cols; k += nsg * SW_SIMD) {  // ascending: a tie keeps the earlier
    const float v = xr[k];
    if (v == v && (bi == SW_NO_INDEX || v > bv)) bv = v, bi = k;
  }
  group_best(bv, bi, rv, ri, lane, sg, nsg);
  if (tid == 0) out[tg.x] = bi == SW_NO_INDEX ? 0 : bi;
}

// out[r] = max + log(sum exp(x - max)) of row r (finite logits).
kernel void logsumexp_rows(device const float* x       [[buffer(0)]],  // [rows, cols]
                           device float* out           [[buffer(1)]],  // [rows]
                           constant SwRowsParams& p    [[buffer(2)]],
                           threadgroup float* part     SW_THREADGROUP_ARG(0),  // [SW_LSE_LANES]
                           uint3 tg                    [[threadgroup_position_in_grid]],
                           uint tid                    [[thread_index_in_threadgroup]],
                           uint lane                   [[thread_index_in_simdgroup]],
                           uint sg                     [[simdgroup_index_in_threadgroup]],
                           uint nsg                    [[simdgroups_per_threadgroup]])
{
  const int n = p.cols, nthr = nsg * SW_SIMD;
  device const float* xr = x + size_t(tg.x) * n;
  float m = xr[0];
  for (int k = tid; k < n; k += nthr) m = max(m, xr[k]);
  m = simd_max(m);
  if (lane == 0) part[sg] = m;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = 0; s < nsg; ++s) m = max(m, part[s]);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the maxima are read before the sums land
  for (int v = tid; v < SW_LSE_LANES; v += nthr) {
    float s = 0.0f;
    for (int k = v; k < n; k += SW_LSE_LANES) s += exp(xr[k] - m);
    part[v] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float s = part[lane];
    for (int v = lane + SW_SIMD; v < SW_LSE_LANES; v += SW_SIMD) s += part[v];
    s = simd_sum(s);
    if (lane == 0) out[tg.x] = m + log(s);
  }
}

// The k (<= 16) best ids of row r other than skip[r] (-1: none), best first, an equal value's
// lower id first, NaN never; ids [rows, k] (-1 where fewer qualify) and their values [rows, k]
// (0 there). Each thread keeps its own best k of a strided pass; k rounds then pick the
// group's best head and pop it from its thread's list.
kernel void top_k_rows(device const float* x           [[buffer(0)]],  // [rows, cols]
                       device const int* skip          [[buffer(1)]],  // [rows]
                       device int* ids                 [[buffer(2)]],  // [rows, k]
                       device float* vals              [[buffer(3)]],  // [rows, k]
                       constant SwRowsParams& p        [[buffer(4)]],
                       threadgroup float* rv           SW_THREADGROUP_ARG(0),  // [nsg]
                       threadgroup int* ri             SW_THREADGROUP_ARG(1),  // [nsg]
                       uint3 tg                        [[threadgroup_position_in_grid]],
                       uint tid                        [[thread_index_in_threadgroup]],
                       uint lane                       [[thread_index_in_simdgroup]],
                       uint sg                         [[simdgroup_index_in_threadgroup]],
                       uint nsg                        [[simdgroups_per_threadgroup]])
{
  const int r = tg.x, K = min(p.k, int(SW_TOPK_MAX)), sk = skip[r];
  if (K <= 0) return;  // the whole group: no barrier is left half reached
  device const float* xr = x + size_t(r) * p.cols;
  float lv[SW_TOPK_MAX];
  int li[SW_TOPK_MAX];
  int cnt = 0;
  for (int k = tid; k < p.cols; k += nsg * SW_SIMD) {  // ascending: an equal value stays behind
    const float v = xr[k];
    if (v != v || k == sk || (cnt == K && !(v > lv[K - 1]))) continue;
    int at = cnt < K ? cnt : K - 1;
    for (; at > 0 && lv[at - 1] < v; --at) lv[at] = lv[at - 1], li[at] = li[at - 1];
    lv[at] = v, li[at] = k;
    cnt = min(cnt + 1, K);
  }
  int head = 0;
  for (int j = 0; j < K; ++j) {
    float bv = head < cnt ? lv[head] : 0.0f;
    int bi = head < cnt ? li[head] : SW_NO_INDEX;
    group_best(bv, bi, rv, ri, lane, sg, nsg);
    if (head < cnt && li[head] == bi) ++head;
    if (tid == 0) {
      ids[r * K + j] = bi == SW_NO_INDEX ? -1 : bi;
      vals[r * K + j] = bi == SW_NO_INDEX ? 0.0f : bv;
    }
  }
}

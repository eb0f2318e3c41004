// Q8 matmul for 1..16 rows, the SYCL twin of metal/q8_matmul.metal: exact int32 dots (lane-
// strided over 4-byte chunks, sub-group sum), y = float(dot) * w_scale[o] * x_scale[r].
#pragma once
#include "sw_sycl_common.hpp"

namespace swsycl {

// One work-group per row: per-item max, sub-group max, then across sub-groups via local memory.
template <class It>
void q8_quantize_rows(const It& it, const Q8Args& a, float* red /* local [n_subgroups] */) {
  const int r = int(it.get_group(0)), tid = int(it.get_local_id(0)), nthr = int(it.get_local_range(0));
  const float* xr = a.x + r * a.cols;
  float amax = 0.0f;
  for (int k = tid; k < a.cols; k += nthr) amax = fmax(amax, fabs(xr[k]));
  amax = sg_max(it, amax);
  if (sg_lane(it) == 0) red[sg_index(it)] = amax;
  barrier(it);
  for (int s = 0; s < sg_count(it); ++s) amax = fmax(amax, red[s]);
  const float scale = amax / 127.0f;
  if (tid == 0) a.xs[r] = scale;
  for (int k = tid; k < a.cols_pad; k += nthr) {
    const float qv = (k < a.cols && scale != 0.0f) ? clampf(rint(xr[k] / scale), -127.0f, 127.0f) : 0.0f;
    a.xq[r * a.cols_pad + k] = int8_t(qv);
  }
}

// One sub-group per output channel, 8 per work-group.
template <class It>
void q8_matmul(const It& it, const Q8Args& a) {
  const int lane = sg_lane(it), o = int(it.get_group(0)) * sg_count(it) + sg_index(it);
  if (o >= a.out_features) return;  // whole sub-group; no barrier in this kernel
  const int8_t* w = a.w + size_t(o) * a.cols_pad;
  int acc[kQ8MaxRows];
  for (int r = 0; r < a.rows; ++r) acc[r] = 0;
  for (int k = 4 * lane; k < a.cols_pad; k += 4 * kSimd) {
    const int w0 = w[k], w1 = w[k + 1], w2 = w[k + 2], w3 = w[k + 3];
    for (int r = 0; r < a.rows; ++r) {
      const int8_t* x = a.xq + r * a.cols_pad + k;
      acc[r] += w0 * x[0] + w1 * x[1] + w2 * x[2] + w3 * x[3];
    }
  }
  for (int r = 0; r < a.rows; ++r) {
    const int d = sg_sum(it, acc[r]);
    if (lane == 0) a.y[r * a.out_features + o] = float(d) * a.w_scale[o] * a.xs[r];
  }
}

}  // namespace swsycl

namespace swsycl {

struct Q4Args {
  const uint8_t* w;       // [out, cols_pad / 2]: runs of 64 inputs in 32 bytes (csrc/weights.h)
  const float* w_scale;   // [out, cols_pad / group]
  const float* w_bias;    // [out, cols_pad / group] (affine only)
  const int8_t* xq;       // [rows, cols_pad] from q8_quantize_rows
  const float* xs;        // [rows]
  float* y;               // [rows, out]
  int rows, cols_pad, out_features;
  int group, affine;      // SwQ4Params': 64 or 32; 1: a bias a group, q the nibble itself
};

// Q4 matmul for 1..16 rows in the CPU's order (metal/q8_matmul.metal q4_matmul, mm_q4_job):
// per row 8 float lanes over runs of 64 inputs; for run s lane l holds the exact int
// I[l] = sum over b = 4l..4l+3 of x[64s+in(b)] q[64s+in(b)] + x[64s+in(b)+h] q[64s+in(b)+h]
// (h = group / 2; in(b) = b for groups of 64, (b / 16) * 32 + b % 16 for groups of 32);
// lane_acc[l] = fma(scale, float(I[l]), lane_acc[l]) with the lane's group's scale, runs in
// order; affine groups then lane_acc[l] = fma(bias, float(X[l]), lane_acc[l]), X[l] the sum of
// the lane's 8 activations; the lanes fold 4-2-1, times the row's activation scale. Each run
// of 8 sub-group lanes is one output's 8 CPU lanes (4 outputs a sub-group): lane l walks the
// runs in order on its own, and only the final fold crosses lanes.
template <class It>
void q4_matmul(const It& it, const Q4Args& a) {
  const int lane = sg_lane(it), l = lane % 8, runs = a.cols_pad / 64, per_run = 64 / a.group, h = a.group / 2;
  const int o = (int(it.get_group(0)) * sg_count(it) + sg_index(it)) * 4 + lane / 8;
  const int gi = 4 * l / h, in_lo = gi * a.group + 4 * l % h;  // the lane's group in a run, first input
  const bool affine = a.affine != 0, live = o < a.out_features;  // every lane stays for the fold
  const int zero = affine ? 0 : 8;  // the nibble's offset
  float acc[kQ8MaxRows];
  for (int r = 0; r < a.rows; ++r) acc[r] = 0.0f;
  if (live) {
    const uint8_t* wrow = a.w + size_t(o) * (a.cols_pad / 2);  // 32 bytes a run
    const float* sc = a.w_scale + size_t(o) * runs * per_run;
    const float* bi = a.w_bias + size_t(o) * runs * per_run;
    for (int s = 0; s < runs; ++s) {
      const uint8_t* b = wrow + s * 32 + 4 * l;  // inputs in_lo.. (low nibbles) and in_lo + h.. (high)
      int lo[4], hi[4];
      for (int e = 0; e < 4; ++e) lo[e] = int(b[e] & 15u) - zero, hi[e] = int(b[e] >> 4) - zero;
      const int g = s * per_run + gi;
      const float scale = sc[g], bias = affine ? bi[g] : 0.0f;
      for (int r = 0; r < a.rows; ++r) {
        const int8_t* xr = a.xq + r * a.cols_pad + s * 64 + in_lo;
        int d = 0, sx = 0;
        for (int e = 0; e < 4; ++e) d += int(xr[e]) * lo[e] + int(xr[h + e]) * hi[e], sx += int(xr[e]) + int(xr[h + e]);
        acc[r] = fma(scale, float(d), acc[r]);
        if (affine) acc[r] = fma(bias, float(sx), acc[r]);
      }
    }
  }
  for (int r = 0; r < a.rows; ++r) {  // lanes 8k..8k+7 hold lane_acc[0..7]: fold 4-2-1 as the CPU
    float v = acc[r];
    v = v + sg_shuffle(it, v, (lane + 4) % kSimd);
    v = v + sg_shuffle(it, v, (lane + 2) % kSimd);
    v = v + sg_shuffle(it, v, (lane + 1) % kSimd);
    if (live && l == 0) a.y[r * a.out_features + o] = v * a.xs[r];
  }
}

}  // namespace swsycl

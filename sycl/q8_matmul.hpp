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
  const uint8_t* w;       // [out, cols_pad / 2]: byte j of a 64-input group holds inputs j (low), j + 32 (high), q + 8
  const float* w_scale;   // [out, cols_pad / 64]
  const int8_t* xq;       // [rows, cols_pad] from q8_quantize_rows
  const float* xs;        // [rows]
  float* y;               // [rows, out]
  int rows, cols_pad, out_features;
};

// Q4 matmul for 1..16 rows in the CPU's order (metal/q8_matmul.metal q4_matmul): per row 8
// float lanes; for 64-input group g lane l holds the exact int I[l] = sum over j = 4l..4l+3 of
// x[64g+j] q[64g+j] + x[64g+32+j] q[64g+32+j]; lane_acc[l] = fma(scale_g, float(I[l]),
// lane_acc[l]) over groups in order; the lanes fold 4-2-1, times the row's activation scale.
// Each run of 8 sub-group lanes is one output's 8 CPU lanes (4 outputs a sub-group): lane l
// walks the groups in order on its own, and only the final fold crosses lanes.
template <class It>
void q4_matmul(const It& it, const Q4Args& a) {
  const int lane = sg_lane(it), l = lane % 8, G = a.cols_pad / 64;
  const int o = (int(it.get_group(0)) * sg_count(it) + sg_index(it)) * 4 + lane / 8;
  const bool live = o < a.out_features;  // every lane stays for the fold's shuffles
  float acc[kQ8MaxRows];
  for (int r = 0; r < a.rows; ++r) acc[r] = 0.0f;
  if (live) {
    const uint8_t* wrow = a.w + size_t(o) * (a.cols_pad / 2);  // 32 bytes a group
    const float* sc = a.w_scale + size_t(o) * G;
    for (int g = 0; g < G; ++g) {
      const uint8_t* b = wrow + g * 32 + 4 * l;  // inputs 4l.. (low nibbles) and 32+4l.. (high)
      int lo[4], hi[4];
      for (int e = 0; e < 4; ++e) lo[e] = int(b[e] & 15u) - 8, hi[e] = int(b[e] >> 4) - 8;
      const float s = sc[g];
      for (int r = 0; r < a.rows; ++r) {
        const int8_t* xr = a.xq + r * a.cols_pad + g * 64;
        int d = 0;
        for (int e = 0; e < 4; ++e) d += int(xr[4 * l + e]) * lo[e] + int(xr[32 + 4 * l + e]) * hi[e];
        acc[r] = fma(s, float(d), acc[r]);
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

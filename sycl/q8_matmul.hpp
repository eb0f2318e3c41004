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
  const uint8_t* w;       // [out, cols_pad / 2]: runs of 64 inputs in 32 bytes (QMatrix::q4_plain)
  const float* w_scale;   // [out, cols_pad / group]
  const float* w_bias;    // [out, cols_pad / group] (affine only)
  const int8_t* xq;       // [rows, cols_pad] from q8_quantize_rows
  const float* xs;        // [rows]
  float* y;               // [rows, out]
  int rows, cols_pad, out_features;
  int group, affine;      // SwQ4Params': 64 or 32; 1: a bias a group, q the nibble itself
};

// Q4 matmul for 1..16 rows in the CPU's order (metal/q8_matmul.metal q4_matmul, mm_q4_job):
// per (row, output), for each input group in order, I = the group's exact int32 dot, acc =
// fma(scale, float(I), acc), affine groups then acc = fma(bias, float(X), acc) with X the
// group's activation sum; y = acc * the row's activation scale. Each run of 8 sub-group lanes
// is one output (4 a sub-group), lane l takes 8 inputs of each 64-input run, xor shuffles sum a
// group's lanes exactly, and every lane runs the same fma chain; lanes of outputs past the end
// read nothing but stay for the shuffles.
template <class It>
void q4_matmul(const It& it, const Q4Args& a) {
  const int lane = sg_lane(it), l = lane % 8, runs = a.cols_pad / 64, per_run = 64 / a.group, h = a.group / 2;
  const int o = (int(it.get_group(0)) * sg_count(it) + sg_index(it)) * 4 + lane / 8;
  const int in_lo = (4 * l / h) * a.group + 4 * l % h;  // the lane's first low-nibble input in a run
  const bool affine = a.affine != 0, live = o < a.out_features;
  const int zero = affine ? 0 : 8;  // the nibble's offset
  const int oc = live ? o : 0;      // dead lanes read row 0 and discard it
  const uint8_t* wrow = a.w + size_t(oc) * (a.cols_pad / 2);  // 32 bytes a run
  const float* sc = a.w_scale + size_t(oc) * runs * per_run;
  const float* bi = a.w_bias + size_t(oc) * runs * per_run;
  float acc[kQ8MaxRows];
  for (int r = 0; r < a.rows; ++r) acc[r] = 0.0f;
  for (int s = 0; s < runs; ++s) {
    const uint8_t* b = wrow + s * 32 + 4 * l;  // inputs in_lo.. (low nibbles) and in_lo + h.. (high)
    int lo[4], hi[4];
    for (int e = 0; e < 4; ++e) lo[e] = int(b[e] & 15u) - zero, hi[e] = int(b[e] >> 4) - zero;
    for (int r = 0; r < a.rows; ++r) {
      const int8_t* xr = a.xq + r * a.cols_pad + s * 64 + in_lo;
      int d = 0, sx = 0;
      for (int e = 0; e < 4; ++e) d += int(xr[e]) * lo[e] + int(xr[h + e]) * hi[e], sx += int(xr[e]) + int(xr[h + e]);
      d += sg_shuffle_xor(it, d, 1);
      sx += sg_shuffle_xor(it, sx, 1);
      d += sg_shuffle_xor(it, d, 2);
      sx += sg_shuffle_xor(it, sx, 2);  // 4 lanes: 32 inputs
      const int d_o = sg_shuffle_xor(it, d, 4);
      const int sx_o = sg_shuffle_xor(it, sx, 4);
      if (per_run == 1) {  // one group of 64
        acc[r] = fma(sc[s], float(d + d_o), acc[r]);
        if (affine) acc[r] = fma(bi[s], float(sx + sx_o), acc[r]);
      } else {             // groups 2s (lanes 0-3) and 2s + 1 (lanes 4-7)
        const bool first = l < 4;
        acc[r] = fma(sc[2 * s], float(first ? d : d_o), acc[r]);
        acc[r] = fma(bi[2 * s], float(first ? sx : sx_o), acc[r]);
        acc[r] = fma(sc[2 * s + 1], float(first ? d_o : d), acc[r]);
        acc[r] = fma(bi[2 * s + 1], float(first ? sx_o : sx), acc[r]);
      }
    }
  }
  for (int r = 0; r < a.rows; ++r)
    if (live && l == 0) a.y[r * a.out_features + o] = acc[r] * a.xs[r];
}

}  // namespace swsycl

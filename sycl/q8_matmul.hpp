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

// Float matmuls for 1..16 rows, the SYCL twins of metal/matmul.metal: y[r][o] = sum_k x[r][k] *
// w[o][k], w row-major [out, cols] in fp32 (matmul_f32) or bf16 bits (matmul_bf16).
//
// Canonical order (fixed by cols only): lane l accumulates k = l, l+32, ... in order by
// fma(x, w, acc); sg_sum folds the 32 lane sums. One sub-group per output channel, every row
// reusing each weight load, so a row's result never depends on how many rows share the launch.
#pragma once
#include "sw_sycl_common.hpp"

namespace swsycl {

struct MatmulArgs {
  const void* w;   // [out, cols]: float or bf16 bits
  const float* x;  // [rows, cols]
  float* y;        // [rows, out]
  int rows, cols, out_features;
};

template <class It, class Weight>
inline void matmul_rows(const It& it, const MatmulArgs& a, Weight weight) {
  const int lane = sg_lane(it), o = int(it.get_group(0)) * sg_count(it) + sg_index(it), K = a.cols;
  if (o >= a.out_features) return;  // whole sub-group; no barrier in this kernel
  float acc[kQ8MaxRows];
  for (int r = 0; r < a.rows; ++r) acc[r] = 0.0f;
  for (int k = lane; k < K; k += kSimd) {
    const float wv = weight(size_t(o) * K + k);
    for (int r = 0; r < a.rows; ++r) acc[r] = fma(a.x[r * K + k], wv, acc[r]);
  }
  for (int r = 0; r < a.rows; ++r) {
    const float d = sg_sum(it, acc[r]);
    if (lane == 0) a.y[r * a.out_features + o] = d;
  }
}

template <class It> void matmul_f32(const It& it, const MatmulArgs& a) {
  const float* w = static_cast<const float*>(a.w);
  matmul_rows(it, a, [&](size_t e) { return w[e]; });
}

template <class It> void matmul_bf16(const It& it, const MatmulArgs& a) {
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  matmul_rows(it, a, [&](size_t e) { return bits_to_float(uint32_t(w[e]) << 16); });
}

}  // namespace swsycl

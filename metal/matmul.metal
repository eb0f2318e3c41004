// Float matmuls for 1..16 rows: y[r][o] = sum_k x[r][k] * w[o][k], w plain row-major [out, cols]
// in fp32 (matmul_f32) or bf16 bits (matmul_bf16, x fp32), as the backend repacks at load.
//
// Canonical order (fixed by cols only): lane l of a simdgroup accumulates k = l, l+32, ... in
// order by fma(x, w, acc); simd_sum folds the 32 lane sums. One simdgroup per output channel
// (8 per 256-thread threadgroup; any count gives the same bits), every row reusing each weight
// load, so each weight is read once per launch and a row's result never depends on how many
// rows share it. The order differs from the CPU's sequential chain: CPU and GPU agree to
// tolerance, not bitwise.
#include <metal_stdlib>
#include "sw_common.h"
using namespace metal;

kernel void matmul_f32(device const float* w           [[buffer(0)]],  // [out, cols]
                       device const float* x           [[buffer(1)]],  // [rows, cols]
                       device float* y                 [[buffer(2)]],  // [rows, out]
                       constant SwQ8Params& p          [[buffer(3)]],
                       uint3 tg                        [[threadgroup_position_in_grid]],
                       uint lane                       [[thread_index_in_simdgroup]],
                       uint sg                         [[simdgroup_index_in_threadgroup]],
                       uint nsg                        [[simdgroups_per_threadgroup]])
{
  const int o = tg.x * nsg + sg, K = p.cols;
  if (o >= p.out_features) return;  // whole simdgroup; no barrier in this kernel
  device const float* wr = w + size_t(o) * K;
  float acc[SW_Q8_MAX_ROWS];
  for (int r = 0; r < p.rows; ++r) acc[r] = 0.0f;
  for (int k = lane; k < K; k += SW_SIMD) {
    const float wv = wr[k];
    for (int r = 0; r < p.rows; ++r) acc[r] = fma(x[r * K + k], wv, acc[r]);
  }
  for (int r = 0; r < p.rows; ++r) {
    const float d = simd_sum(acc[r]);
    if (lane == 0) y[r * p.out_features + o] = d;
  }
}

kernel void matmul_bf16(device const ushort* w         [[buffer(0)]],  // [out, cols] bf16 bits
                        device const float* x          [[buffer(1)]],  // [rows, cols]
                        device float* y                [[buffer(2)]],  // [rows, out]
                        constant SwQ8Params& p         [[buffer(3)]],
                        uint3 tg                       [[threadgroup_position_in_grid]],
                        uint lane                      [[thread_index_in_simdgroup]],
                        uint sg                        [[simdgroup_index_in_threadgroup]],
                        uint nsg                       [[simdgroups_per_threadgroup]])
{
  const int o = tg.x * nsg + sg, K = p.cols;
  if (o >= p.out_features) return;
  device const ushort* wr = w + size_t(o) * K;
  float acc[SW_Q8_MAX_ROWS];
  for (int r = 0; r < p.rows; ++r) acc[r] = 0.0f;
  for (int k = lane; k < K; k += SW_SIMD) {
    const float wv = as_type<float>(uint(wr[k]) << 16);
    for (int r = 0; r < p.rows; ++r) acc[r] = fma(x[r * K + k], wv, acc[r]);
  }
  for (int r = 0; r < p.rows; ++r) {
    const float d = simd_sum(acc[r]);
    if (lane == 0) y[r * p.out_features + o] = d;
  }
}

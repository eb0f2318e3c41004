// Q8 matmul for 1..16 rows: y[r][o] = float(sum_k w[o][k] * xq[r][k]) * w_scale[o] * x_scale[r].
// Weights are int8 with one scale per output channel; activations are quantized per row
// (scale = amax / 127, the CPU's QActs rule) by q8_quantize_rows. The dot is an exact int32
// sum, so any lane split or reduction tree gives the same integer; the only float rounding is
// the final two products, done in the CPU's order. A row's result therefore never depends on
// how many rows share the launch.
#include <metal_stdlib>
#include "sw_common.h"
using namespace metal;

// One threadgroup per row: amax by per-thread max, simd_max, then across simdgroups through
// threadgroup memory (max is exact, so the order is free).
kernel void q8_quantize_rows(device const float* x     [[buffer(0)]],  // [rows, cols]
                             device char* xq           [[buffer(1)]],  // [rows, cols_pad]
                             device float* xs          [[buffer(2)]],  // [rows]
                             constant SwQ8Params& p    [[buffer(3)]],
                             threadgroup float* red    SW_THREADGROUP_ARG(0),  // [nsg]
                             uint3 tg                  [[threadgroup_position_in_grid]],
                             uint tid                  [[thread_index_in_threadgroup]],
                             uint lane                 [[thread_index_in_simdgroup]],
                             uint sg                   [[simdgroup_index_in_threadgroup]],
                             uint nsg                  [[simdgroups_per_threadgroup]])
{
  const int r = tg.x, nthr = nsg * SW_SIMD;
  device const float* xr = x + r * p.cols;
  float amax = 0.0f;
  for (int k = tid; k < p.cols; k += nthr) amax = max(amax, abs(xr[k]));
  amax = simd_max(amax);
  if (lane == 0) red[sg] = amax;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = 0; s < nsg; ++s) amax = max(amax, red[s]);
  const float scale = amax / 127.0f;
  if (tid == 0) xs[r] = scale;
  for (int k = tid; k < p.cols_pad; k += nthr) {
    const float qv = (k < p.cols && scale != 0.0f) ? clamp(rint(xr[k] / scale), -127.0f, 127.0f) : 0.0f;
    xq[r * p.cols_pad + k] = char(qv);
  }
}

// One simdgroup per output channel (8 per threadgroup): lanes stride over char4 chunks of the
// weight row, every row of activations reuses each weight load; simd_sum per row.
kernel void q8_matmul(device const char* w           [[buffer(0)]],  // [out, cols_pad]
                      device const float* w_scale    [[buffer(1)]],  // [out]
                      device const char* xq          [[buffer(2)]],  // [rows, cols_pad]
                      device const float* xs         [[buffer(3)]],  // [rows]
                      device float* y                [[buffer(4)]],  // [rows, out]
                      constant SwQ8Params& p         [[buffer(5)]],
                      uint3 tg                       [[threadgroup_position_in_grid]],
                      uint lane                      [[thread_index_in_simdgroup]],
                      uint sg                        [[simdgroup_index_in_threadgroup]],
                      uint nsg                       [[simdgroups_per_threadgroup]])
{
  const int o = tg.x * nsg + sg;
  if (o >= p.out_features) return;  // whole simdgroup; no barrier in this kernel
  const int n4 = p.cols_pad / 4;
  device const char4* w4 = (device const char4*)(w + size_t(o) * p.cols_pad);
  int acc[SW_Q8_MAX_ROWS];
  for (int r = 0; r < p.rows; ++r) acc[r] = 0;
  for (int k4 = lane; k4 < n4; k4 += SW_SIMD) {
    const int4 wv = int4(w4[k4]);
    for (int r = 0; r < p.rows; ++r) {
      const int4 prod = wv * int4(((device const char4*)(xq + r * p.cols_pad))[k4]);
      acc[r] += prod.x + prod.y + prod.z + prod.w;
    }
  }
  for (int r = 0; r < p.rows; ++r) {
    const int d = simd_sum(acc[r]);
    if (lane == 0) y[r * p.out_features + o] = float(d) * w_scale[o] * xs[r];
  }
}

// Q4 matmul for 1..16 rows over the int8 activations of q8_quantize_rows, in the CPU's order
// (csrc/kernels/matmul.inc, mm_q4_job), so its bits are the CPU's: per row 8 float lanes; for
// group g (64 inputs) lane l holds the exact int
//   I[l] = sum_{j=4l}^{4l+3} x[64g+j] q[64g+j] + x[64g+32+j] q[64g+32+j],
// lane_acc[l] = fma(scale_g, float(I[l]), lane_acc[l]) over groups in order; the lanes fold
// 4-2-1 and the sum is multiplied by the row's activation scale. Here each run of 8 simdgroup
// lanes is one output's 8 CPU lanes (a simdgroup computes 4 outputs, a 256-thread group 32):
// lane l walks the groups in order on its own, and only the final fold crosses lanes.
// Weights as the CPU packs them (csrc/weights.h): [out, cols_pad / 2] bytes, byte j of a group
// holding input j (low nibble) and j + 32 (high), q + 8; scales [out, cols_pad / 64].
kernel void q4_matmul(device const uchar* w          [[buffer(0)]],  // [out, cols_pad / 2]
                      device const float* w_scale    [[buffer(1)]],  // [out, cols_pad / 64]
                      device const char* xq          [[buffer(2)]],  // [rows, cols_pad]
                      device const float* xs         [[buffer(3)]],  // [rows]
                      device float* y                [[buffer(4)]],  // [rows, out]
                      constant SwQ8Params& p         [[buffer(5)]],
                      uint3 tg                       [[threadgroup_position_in_grid]],
                      uint lane                      [[thread_index_in_simdgroup]],
                      uint sg                        [[simdgroup_index_in_threadgroup]],
                      uint nsg                       [[simdgroups_per_threadgroup]])
{
  const int o = (tg.x * nsg + sg) * 4 + lane / 8, l = lane % 8, G = p.cols_pad / SW_Q4_GROUP;
  const bool live = o < p.out_features;  // every lane stays for the fold's shuffles
  float acc[SW_Q8_MAX_ROWS];
  for (int r = 0; r < p.rows; ++r) acc[r] = 0.0f;
  if (live) {
    device const uint* wrow = (device const uint*)(w + size_t(o) * (p.cols_pad / 2));  // 8 words a group
    device const float* sc = w_scale + size_t(o) * G;
    for (int g = 0; g < G; ++g) {
      const uint b = wrow[g * 8 + l];  // bytes 4l..4l+3: inputs 4l.. (low nibbles) and 32+4l.. (high)
      const int4 lo = int4(int(b & 15u), int((b >> 8) & 15u), int((b >> 16) & 15u), int((b >> 24) & 15u)) -
                      int4(8, 8, 8, 8);
      const int4 hi = int4(int((b >> 4) & 15u), int((b >> 12) & 15u), int((b >> 20) & 15u), int(b >> 28)) -
                      int4(8, 8, 8, 8);
      const float s = sc[g];
      for (int r = 0; r < p.rows; ++r) {
        device const char4* xr = (device const char4*)(xq + r * p.cols_pad + g * SW_Q4_GROUP);
        const int4 d = int4(xr[l]) * lo + int4(xr[8 + l]) * hi;
        acc[r] = fma(s, float(d.x + d.y + d.z + d.w), acc[r]);
      }
    }
  }
  for (int r = 0; r < p.rows; ++r) {  // lanes 8k..8k+7 hold lane_acc[0..7]: fold 4-2-1 as the CPU
    float v = acc[r];
    v = v + simd_shuffle(v, ushort((lane + 4) % SW_SIMD));
    v = v + simd_shuffle(v, ushort((lane + 2) % SW_SIMD));
    v = v + simd_shuffle(v, ushort((lane + 1) % SW_SIMD));
    if (live && l == 0) y[r * p.out_features + o] = v * xs[r];
  }
}

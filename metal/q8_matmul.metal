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
// (csrc/kernels/matmul.inc, mm_q4_job), so its bits are the CPU's: per row 8 float lanes over
// runs of 64 inputs; for run s lane l holds the exact int
//   I[l] = sum_{b=4l}^{4l+3} x[64s+in(b)] q[64s+in(b)] + x[64s+in(b)+h] q[64s+in(b)+h],
// h = group / 2 (the high nibble's offset), in(b) = b for groups of 64, (b / 16) * 32 + b % 16
// for groups of 32; lane_acc[l] = fma(scale, float(I[l]), lane_acc[l]) with the scale of the
// lane's group (run s; groups of 32: 2s + l / 4), runs in order; affine groups then add
// lane_acc[l] = fma(bias, float(X[l]), lane_acc[l]), X[l] the sum of the lane's 8 activations.
// The lanes fold 4-2-1 and the sum is multiplied by the row's activation scale. Here each run
// of 8 simdgroup lanes is one output's 8 CPU lanes (a simdgroup computes 4 outputs, a
// 256-thread group 32): lane l walks the runs in order on its own, and only the final fold
// crosses lanes.
// Weights as the CPU packs them (csrc/weights.h): [out, cols_pad / 2] bytes, 32 a run; groups
// of 64: byte j holds input j (low nibble) and j + 32 (high); groups of 32: bytes 16i + j hold
// inputs 32i + j and 32i + j + 16. Symmetric: q + 8, weight (q - 8) * scale; affine: the nibble
// q itself, weight q * scale + bias. Scales (and biases) [out, cols_pad / group].
kernel void q4_matmul(device const uchar* w          [[buffer(0)]],  // [out, cols_pad / 2]
                      device const float* w_scale    [[buffer(1)]],  // [out, cols_pad / group]
                      device const float* w_bias     [[buffer(2)]],  // [out, cols_pad / group] (affine)
                      device const char* xq          [[buffer(3)]],  // [rows, cols_pad]
                      device const float* xs         [[buffer(4)]],  // [rows]
                      device float* y                [[buffer(5)]],  // [rows, out]
                      constant SwQ4Params& p         [[buffer(6)]],
                      uint3 tg                       [[threadgroup_position_in_grid]],
                      uint lane                      [[thread_index_in_simdgroup]],
                      uint sg                        [[simdgroup_index_in_threadgroup]],
                      uint nsg                       [[simdgroups_per_threadgroup]])
{
  const int o = (tg.x * nsg + sg) * 4 + lane / 8, l = lane % 8;
  const int runs = p.cols_pad / SW_Q4_GROUP, per_run = SW_Q4_GROUP / p.group, h = p.group / 2;
  const int gi = 4 * l / h;                         // the lane's group within a run
  const int in_lo = gi * p.group + 4 * l % h;       // its first low-nibble input in the run
  const bool affine = p.affine != 0, live = o < p.out_features;  // every lane stays for the fold
  const int zero = affine ? 0 : 8;                  // the nibble's offset
  float acc[SW_Q8_MAX_ROWS];
  for (int r = 0; r < p.rows; ++r) acc[r] = 0.0f;
  if (live) {
    device const uint* wrow = (device const uint*)(w + size_t(o) * (p.cols_pad / 2));  // 8 words a run
    device const float* sc = w_scale + size_t(o) * runs * per_run;
    device const float* bi = w_bias + size_t(o) * runs * per_run;
    for (int s = 0; s < runs; ++s) {
      const uint b = wrow[s * 8 + l];  // bytes 4l..4l+3: inputs in_lo.. (low nibbles), in_lo + h.. (high)
      const int4 lo = int4(int(b & 15u), int((b >> 8) & 15u), int((b >> 16) & 15u), int((b >> 24) & 15u)) -
                      int4(zero, zero, zero, zero);
      const int4 hi = int4(int((b >> 4) & 15u), int((b >> 12) & 15u), int((b >> 20) & 15u), int(b >> 28)) -
                      int4(zero, zero, zero, zero);
      const int g = s * per_run + gi;
      const float scale = sc[g], bias = affine ? bi[g] : 0.0f;
      for (int r = 0; r < p.rows; ++r) {
        device const char* xr = xq + r * p.cols_pad + s * SW_Q4_GROUP;
        const int4 xl = int4(((device const char4*)(xr + in_lo))[0]);
        const int4 xh = int4(((device const char4*)(xr + in_lo + h))[0]);
        const int4 d = xl * lo + xh * hi;
        acc[r] = fma(scale, float(d.x + d.y + d.z + d.w), acc[r]);
        if (affine) {
          const int4 sx = xl + xh;
          acc[r] = fma(bias, float(sx.x + sx.y + sx.z + sx.w), acc[r]);
        }
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

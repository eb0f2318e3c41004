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
// (csrc/kernels/matmul.inc, mm_q4_job), so its bits are the CPU's: per (row, output), for each
// input group in order, I = the exact int32 dot of the group (symmetric: nibble - 8; affine:
// the nibble), acc = fma(scale, float(I), acc), affine groups then acc = fma(bias, float(X),
// acc) with X the group's activation sum; y = acc * the row's activation scale. An int32 sum
// has no order: each run of 8 simdgroup lanes is one output (a simdgroup computes 4, a
// 256-thread group 32), lane l takes 8 inputs of each 64-input run, and xor shuffles sum a
// group's lanes (4 for groups of 32, 8 for 64) exactly; every lane then runs the same fma
// chain. Lanes of outputs past the end read nothing but stay for the shuffles.
// Weights as the GPU upload hands them (QMatrix::q4_plain): [out, cols_pad / 2] bytes, 32 a
// run; groups of 64: byte j holds input j (low nibble) and j + 32 (high); groups of 32: bytes
// 16i + j hold inputs 32i + j and 32i + j + 16. Symmetric: q + 8, weight (q - 8) * scale;
// affine: the nibble q itself, weight q * scale + bias. Scales (and biases) [out, cols_pad /
// group].
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
  const int in_lo = (4 * l / h) * p.group + 4 * l % h;  // the lane's first low-nibble input in a run
  const bool affine = p.affine != 0, live = o < p.out_features;
  const int zero = affine ? 0 : 8;                       // the nibble's offset
  const int oc = live ? o : 0;                           // dead lanes read row 0 and discard it
  device const uint* wrow = (device const uint*)(w + size_t(oc) * (p.cols_pad / 2));  // 8 words a run
  device const float* sc = w_scale + size_t(oc) * runs * per_run;
  device const float* bi = w_bias + size_t(oc) * runs * per_run;
  float acc[SW_Q8_MAX_ROWS];
  for (int r = 0; r < p.rows; ++r) acc[r] = 0.0f;
  for (int s = 0; s < runs; ++s) {
    const uint b = wrow[s * 8 + l];  // bytes 4l..4l+3: inputs in_lo.. (low nibbles), in_lo + h.. (high)
    const int4 lo = int4(int(b & 15u), int((b >> 8) & 15u), int((b >> 16) & 15u), int((b >> 24) & 15u)) -
                    int4(zero, zero, zero, zero);
    const int4 hi = int4(int((b >> 4) & 15u), int((b >> 12) & 15u), int((b >> 20) & 15u), int(b >> 28)) -
                    int4(zero, zero, zero, zero);
    for (int r = 0; r < p.rows; ++r) {
      device const char* xr = xq + r * p.cols_pad + s * SW_Q4_GROUP;
      const int4 xl = int4(((device const char4*)(xr + in_lo))[0]);
      const int4 xh = int4(((device const char4*)(xr + in_lo + h))[0]);
      const int4 dv = xl * lo + xh * hi, sv = xl + xh;
      int d = dv.x + dv.y + dv.z + dv.w, sx = sv.x + sv.y + sv.z + sv.w;
      d += simd_shuffle_xor(d, ushort(1));
      sx += simd_shuffle_xor(sx, ushort(1));
      d += simd_shuffle_xor(d, ushort(2));
      sx += simd_shuffle_xor(sx, ushort(2));  // 4 lanes: 32 inputs
      const int d_o = simd_shuffle_xor(d, ushort(4));
      const int sx_o = simd_shuffle_xor(sx, ushort(4));
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
  for (int r = 0; r < p.rows; ++r)
    if (live && l == 0) y[r * p.out_features + o] = acc[r] * xs[r];
}

// Elementwise and gather ops of the forward (docs/design.md "The model"): embedding rows in every
// weight format, the residual add, the SiLU / sigmoid gates, the q|gate split, rotary, the GDN
// gates and the KV tape's row gather.
//
// Canonical order: none needed. Every output element is a function of its own inputs only
// (no reduction), computed with the same operations in the same order wherever it sits, so a
// row's result never depends on the launch; dequantization is float(q) * scale, the CPU's
// QMatrix::dequant_row, hence the same bits as the CPU's embedding rows.
//
// Launch: the per-row gathers (embed_rows_*) take one threadgroup per token, any multiple of
// 32 threads striding over the hidden dims; the flat ops take ceil(total / threads)
// threadgroups, element i = group * threads + thread. No barriers, so threads past the end
// return at once.
#include <metal_stdlib>
#include "sw_common.h"
using namespace metal;

kernel void embed_rows_f32(device const int* tokens     [[buffer(0)]],  // [n]
                           device const float* table    [[buffer(1)]],  // [vocab, hidden]
                           device float* x              [[buffer(2)]],  // [n, hidden]
                           constant SwEmbedParams& p    [[buffer(3)]],
                           uint3 tg                     [[threadgroup_position_in_grid]],
                           uint tid                     [[thread_index_in_threadgroup]],
                           uint nsg                     [[simdgroups_per_threadgroup]])
{
  const int r = tg.x, t = tokens[r], H = p.hidden;
  const bool ok = t >= 0 && t < p.vocab;  // the host checks; never read outside the table
  for (int k = tid; k < H; k += nsg * SW_SIMD) x[r * H + k] = ok ? table[size_t(t) * H + k] : 0.0f;
}

kernel void embed_rows_bf16(device const int* tokens    [[buffer(0)]],  // [n]
                            device const ushort* table  [[buffer(1)]],  // [vocab, hidden] bf16 bits
                            device float* x             [[buffer(2)]],  // [n, hidden]
                            constant SwEmbedParams& p   [[buffer(3)]],
                            uint3 tg                    [[threadgroup_position_in_grid]],
                            uint tid                    [[thread_index_in_threadgroup]],
                            uint nsg                    [[simdgroups_per_threadgroup]])
{
  const int r = tg.x, t = tokens[r], H = p.hidden;
  const bool ok = t >= 0 && t < p.vocab;
  for (int k = tid; k < H; k += nsg * SW_SIMD)
    x[r * H + k] = ok ? as_type<float>(uint(table[size_t(t) * H + k]) << 16) : 0.0f;
}

kernel void embed_rows_q8(device const int* tokens      [[buffer(0)]],  // [n]
                          device const char* table      [[buffer(1)]],  // [vocab, cols_pad] int8
                          device const float* scale     [[buffer(2)]],  // [vocab]
                          device float* x               [[buffer(3)]],  // [n, hidden]
                          constant SwEmbedParams& p     [[buffer(4)]],
                          uint3 tg                      [[threadgroup_position_in_grid]],
                          uint tid                      [[thread_index_in_threadgroup]],
                          uint nsg                      [[simdgroups_per_threadgroup]])
{
  const int r = tg.x, t = tokens[r], H = p.hidden;
  const bool ok = t >= 0 && t < p.vocab;
  for (int k = tid; k < H; k += nsg * SW_SIMD)
    x[r * H + k] = ok ? float(table[size_t(t) * p.cols_pad + k]) * scale[t] : 0.0f;
}

// q4 as the CPU packs it (csrc/weights.h, QMatrix::q4_byte): runs of 64 inputs in 32 bytes;
// groups of 64: byte j holds input j in its low nibble and input j + 32 in its high one; groups
// of 32 (affine only): bytes 16i + j hold inputs 32i + j and 32i + j + 16. One scale (and for
// affine one bias) per (row, group). The value is QMatrix::dequant_row's: symmetric
// float(q - 8) * scale, affine float(q) * scale + bias (two roundings, no fma).
kernel void embed_rows_q4(device const int* tokens      [[buffer(0)]],  // [n]
                          device const uchar* table     [[buffer(1)]],  // [vocab, cols_pad / 2]
                          device const float* scale     [[buffer(2)]],  // [vocab, cols_pad / group]
                          device const float* bias      [[buffer(3)]],  // [vocab, cols_pad / group] (affine)
                          device float* x               [[buffer(4)]],  // [n, hidden]
                          constant SwEmbedParams& p     [[buffer(5)]],
                          uint3 tg                      [[threadgroup_position_in_grid]],
                          uint tid                      [[thread_index_in_threadgroup]],
                          uint nsg                      [[simdgroups_per_threadgroup]])
{
  const int r = tg.x, t = tokens[r], H = p.hidden, G = p.cols_pad / p.group, half = p.group / 2;
  const bool ok = t >= 0 && t < p.vocab;
  for (int k = tid; k < H; k += nsg * SW_SIMD) {
    float v = 0.0f;
    if (ok) {
      const int j = k % SW_Q4_GROUP, g = k / p.group;
      const uint b = table[size_t(t) * (p.cols_pad / 2) + (k - j) / 2 + (j / p.group) * half + j % half];
      const int q = int(k % p.group < half ? (b & 15u) : (b >> 4));
      const size_t sg = size_t(t) * G + g;
      if (p.affine) {
        const float qs = float(q) * scale[sg];  // rounded before the add, as the CPU
        v = qs + bias[sg];
      } else {
        v = float(q - 8) * scale[sg];
      }
    }
    x[r * H + k] = v;
  }
}

// x += y over n floats (the residual add).
kernel void add_inplace(device float* x                [[buffer(0)]],
                        device const float* y          [[buffer(1)]],
                        constant SwEltParams& p        [[buffer(2)]],
                        uint3 tg                       [[threadgroup_position_in_grid]],
                        uint tid                       [[thread_index_in_threadgroup]],
                        uint nsg                       [[simdgroups_per_threadgroup]])
{
  const int i = tg.x * nsg * SW_SIMD + tid;
  if (i < p.n) x[i] = x[i] + y[i];
}

// out = silu(x) * u, silu(x) = x / (1 + exp(-x)) (the CPU's silu_canon form); out may alias x or u.
kernel void silu_mul(device const float* x             [[buffer(0)]],
                     device const float* u             [[buffer(1)]],
                     device float* out                 [[buffer(2)]],
                     constant SwEltParams& p           [[buffer(3)]],
                     uint3 tg                          [[threadgroup_position_in_grid]],
                     uint tid                          [[thread_index_in_threadgroup]],
                     uint nsg                          [[simdgroups_per_threadgroup]])
{
  const int i = tg.x * nsg * SW_SIMD + tid;
  if (i >= p.n) return;
  const float v = x[i];
  out[i] = v / (1.0f + exp(-v)) * u[i];
}

// out = sigmoid(x) * u, sigmoid(x) = 1 / (1 + exp(-x)); out may alias x or u.
kernel void sigmoid_mul(device const float* x          [[buffer(0)]],
                        device const float* u          [[buffer(1)]],
                        device float* out              [[buffer(2)]],
                        constant SwEltParams& p        [[buffer(3)]],
                        uint3 tg                       [[threadgroup_position_in_grid]],
                        uint tid                       [[thread_index_in_threadgroup]],
                        uint nsg                       [[simdgroups_per_threadgroup]])
{
  const int i = tg.x * nsg * SW_SIMD + tid;
  if (i >= p.n) return;
  out[i] = 1.0f / (1.0f + exp(-x[i])) * u[i];
}

// q_proj's output per head [q | gate]: qg [n, Hq, 2D] -> q [n, Hq, D], gate [n, Hq, D].
kernel void split_q_gate(device const float* qg        [[buffer(0)]],
                         device float* q               [[buffer(1)]],
                         device float* gate            [[buffer(2)]],
                         constant SwEltParams& p       [[buffer(3)]],
                         uint3 tg                      [[threadgroup_position_in_grid]],
                         uint tid                      [[thread_index_in_threadgroup]],
                         uint nsg                      [[simdgroups_per_threadgroup]])
{
  const int i = tg.x * nsg * SW_SIMD + tid, D = p.dim;
  if (i >= p.n * p.heads * D) return;
  const int rh = i / D, d = i % D;
  q[i] = qg[rh * 2 * D + d];
  gate[i] = qg[rh * 2 * D + D + d];
}

// Rotate-half RoPE in place on the first rot dims of every head of x [n, heads, dim], from the
// host's (cos, sin) table cs [n, rot/2, 2]; one thread per (row, head, frequency) pair:
// (a, b) = (x[f], x[f + rot/2]) -> (a cos - b sin, b cos + a sin), the CPU's expression.
kernel void rope(device float* x                       [[buffer(0)]],
                 device const float* cs                [[buffer(1)]],
                 constant SwEltParams& p               [[buffer(2)]],
                 uint3 tg                              [[threadgroup_position_in_grid]],
                 uint tid                              [[thread_index_in_threadgroup]],
                 uint nsg                              [[simdgroups_per_threadgroup]])
{
  const int half_rot = p.rot / 2, i = tg.x * nsg * SW_SIMD + tid;
  if (i >= p.n * p.heads * half_rot) return;
  const int f = i % half_rot, rh = i / half_rot, r = rh / p.heads;
  device float* xh = x + size_t(rh) * p.dim;
  const float c = cs[(r * half_rot + f) * 2], s = cs[(r * half_rot + f) * 2 + 1];
  const float a = xh[f], b = xh[f + half_rot];
  xh[f] = a * c - b * s;
  xh[f + half_rot] = b * c + a * s;
}

// log(1 + e) for e = exp(a) >= 0, accurate where 1 + e rounds (MSL has no log1p): the
// correction log(u) * e / (u - 1) with u = 1 + e cancels the rounding of u (Goldberg 1991).
inline float log1p_of(float e) {
  const float u = 1.0f + e;
  return u == 1.0f ? e : log(u) * (e / (u - 1.0f));
}

// The GDN gates per value head j: ba [n, 2 Hv] holds b | a (in_proj_b, in_proj_a);
// beta = sigmoid(b), g = neg_exp_a[j] * softplus(a + dt_bias[j]), softplus(x) = x > 20 ? x :
// log1p(exp(x)) as the CPU's. One thread per (row, head).
kernel void gdn_gates(device const float* ba           [[buffer(0)]],  // [n, 2 hv]
                      device const float* dt_bias      [[buffer(1)]],  // [hv]
                      device const float* neg_exp_a    [[buffer(2)]],  // [hv]: -exp(A_log)
                      device float* beta               [[buffer(3)]],  // [n, hv]
                      device float* g                  [[buffer(4)]],  // [n, hv]
                      constant SwEltParams& p          [[buffer(5)]],
                      uint3 tg                         [[threadgroup_position_in_grid]],
                      uint tid                         [[thread_index_in_threadgroup]],
                      uint nsg                         [[simdgroups_per_threadgroup]])
{
  const int hv = p.heads, i = tg.x * nsg * SW_SIMD + tid;
  if (i >= p.n * hv) return;
  const int r = i / hv, j = i % hv;
  beta[i] = 1.0f / (1.0f + exp(-ba[r * 2 * hv + j]));
  const float a = ba[r * 2 * hv + hv + j] + dt_bias[j];
  g[i] = neg_exp_a[j] * (a > 20.0f ? a : log1p_of(exp(a)));
}

// dst[i] = src[idx[i]], rows of `dim` floats (a committed path's rows of the KV tape).
kernel void gather_rows(device const float* src        [[buffer(0)]],
                        device const int* idx          [[buffer(1)]],  // [n]
                        device float* dst              [[buffer(2)]],  // [n, dim]
                        constant SwEltParams& p        [[buffer(3)]],
                        uint3 tg                       [[threadgroup_position_in_grid]],
                        uint tid                       [[thread_index_in_threadgroup]],
                        uint nsg                       [[simdgroups_per_threadgroup]])
{
  const int i = tg.x * nsg * SW_SIMD + tid;
  if (i >= p.n * p.dim) return;
  dst[i] = src[size_t(idx[i / p.dim]) * p.dim + i % p.dim];
}

// Elementwise and gather ops, the SYCL twins of metal/elementwise.metal (same expressions in the
// same order: every output element is a function of its own inputs only, so no reduction order
// is involved and a row never depends on the launch).
//
// Launch (1-D): embed_rows_*: work-group r = token row r, items striding over the hidden dims;
// the flat ops: element i = group * local_range + local_id, items past the end return at once
// (no barriers).
#pragma once
#include "sw_sycl_common.hpp"

namespace swsycl {

constexpr int kQ4Run = 64;  // q4 weights: inputs a run of 32 bytes (csrc/weights.h, SW_Q4_GROUP)

struct EmbedArgs {  // tokens [n] -> x [n, hidden] from a [vocab, hidden] table
  const int32_t* tokens;
  const void* table;   // float / bf16 bits / int8 [vocab, cols_pad] / q4 bytes [vocab, cols_pad / 2]
  const float* scale;  // q8: [vocab]; q4: [vocab, cols_pad / group]
  const float* bias;   // q4 affine: [vocab, cols_pad / group]
  float* x;
  int n_tokens, hidden, cols_pad, vocab;
  int group, affine;   // q4: SwEmbedParams' (64 or 32; 1: a bias a group, q the nibble itself)
};

// The row gather of every format: x[r][k] = value(t, k), 0 for a token outside the table.
template <class It, class Value>
inline void embed_rows(const It& it, const EmbedArgs& a, Value value) {
  const int r = int(it.get_group(0)), t = a.tokens[r], H = a.hidden, nthr = int(it.get_local_range(0));
  const bool ok = t >= 0 && t < a.vocab;  // the host checks; never read outside the table
  for (int k = int(it.get_local_id(0)); k < H; k += nthr) a.x[r * H + k] = ok ? value(t, k) : 0.0f;
}

template <class It> void embed_rows_f32(const It& it, const EmbedArgs& a) {
  const float* tab = static_cast<const float*>(a.table);
  embed_rows(it, a, [&](int t, int k) { return tab[size_t(t) * a.hidden + k]; });
}

template <class It> void embed_rows_bf16(const It& it, const EmbedArgs& a) {
  const uint16_t* tab = static_cast<const uint16_t*>(a.table);
  embed_rows(it, a, [&](int t, int k) { return bits_to_float(uint32_t(tab[size_t(t) * a.hidden + k]) << 16); });
}

template <class It> void embed_rows_q8(const It& it, const EmbedArgs& a) {
  const int8_t* tab = static_cast<const int8_t*>(a.table);
  embed_rows(it, a, [&](int t, int k) { return float(tab[size_t(t) * a.cols_pad + k]) * a.scale[t]; });
}

// q4 as the CPU packs it (metal/elementwise.metal embed_rows_q4, QMatrix::q4_byte): runs of 64
// inputs in 32 bytes; groups of 64: byte j holds input j (low nibble) and j + 32 (high); groups
// of 32: bytes 16i + j hold inputs 32i + j and 32i + j + 16. QMatrix::dequant_row's value:
// symmetric float(q - 8) * scale, affine float(q) * scale + bias (two roundings, no fma).
template <class It> void embed_rows_q4(const It& it, const EmbedArgs& a) {
  const uint8_t* tab = static_cast<const uint8_t*>(a.table);
  const int G = a.cols_pad / a.group, half = a.group / 2;
  embed_rows(it, a, [&](int t, int k) {
    const int j = k % kQ4Run, g = k / a.group;
    const uint32_t b = tab[size_t(t) * (a.cols_pad / 2) + (k - j) / 2 + (j / a.group) * half + j % half];
    const int q = int(k % a.group < half ? (b & 15u) : (b >> 4));
    const size_t sg = size_t(t) * G + g;
    if (a.affine) {
      const float qs = float(q) * a.scale[sg];  // rounded before the add, as the CPU
      return qs + a.bias[sg];
    }
    return float(q - 8) * a.scale[sg];
  });
}

// The flat ops' buffers by role (each kernel says which it reads) and SwEltParams' fields.
struct EltArgs {
  const float* x;       // add_inplace: y; silu/sigmoid_mul: x; split_q_gate: qg; rope: cs; gates: ba; gather: src
  const float* u;       // silu/sigmoid_mul: u; gdn_gates: dt_bias
  const float* w;       // gdn_gates: neg_exp_a
  float* out;           // add_inplace / rope: x (in place); silu/sigmoid: out; split: q; gates: beta; gather: dst
  float* out2;          // split_q_gate: gate; gdn_gates: g
  const int32_t* idx;   // gather_rows
  int n, heads, dim, rot;
};

template <class It> inline int flat_index(const It& it) {
  return int(it.get_group(0)) * int(it.get_local_range(0)) + int(it.get_local_id(0));
}

template <class It> void add_inplace(const It& it, const EltArgs& a) {  // out += x
  const int i = flat_index(it);
  if (i < a.n) a.out[i] = a.out[i] + a.x[i];
}

// out = silu(x) * u = x / (1 + exp(-x)) * u; out may alias x or u.
template <class It> void silu_mul(const It& it, const EltArgs& a) {
  const int i = flat_index(it);
  if (i >= a.n) return;
  const float v = a.x[i];
  a.out[i] = v / (1.0f + exp(-v)) * a.u[i];
}

template <class It> void sigmoid_mul(const It& it, const EltArgs& a) {  // out = sigmoid(x) * u
  const int i = flat_index(it);
  if (i >= a.n) return;
  a.out[i] = 1.0f / (1.0f + exp(-a.x[i])) * a.u[i];
}

// qg [n, heads, 2 dim] -> q [n, heads, dim] (out), gate [n, heads, dim] (out2).
template <class It> void split_q_gate(const It& it, const EltArgs& a) {
  const int i = flat_index(it), D = a.dim;
  if (i >= a.n * a.heads * D) return;
  const int rh = i / D, d = i % D;
  a.out[i] = a.x[rh * 2 * D + d];
  a.out2[i] = a.x[rh * 2 * D + D + d];
}

// Rotate-half RoPE in place on out [n, heads, dim] from the (cos, sin) table x [n, rot/2, 2]:
// one item per (row, head, frequency).
template <class It> void rope(const It& it, const EltArgs& a) {
  const int half_rot = a.rot / 2, i = flat_index(it);
  if (i >= a.n * a.heads * half_rot) return;
  const int f = i % half_rot, rh = i / half_rot, r = rh / a.heads;
  float* xh = a.out + size_t(rh) * a.dim;
  const float c = a.x[(r * half_rot + f) * 2], s = a.x[(r * half_rot + f) * 2 + 1];
  const float p = xh[f], q = xh[f + half_rot];
  xh[f] = p * c - q * s;
  xh[f + half_rot] = q * c + p * s;
}

// log(1 + e) for e = exp(a) >= 0 where 1 + e rounds (Goldberg 1991), as metal/elementwise.metal.
inline float log1p_of(float e) {
  const float u = 1.0f + e;
  return u == 1.0f ? e : log(u) * (e / (u - 1.0f));
}

// ba [n, 2 heads] = b | a -> beta = sigmoid(b) (out), g = neg_exp_a * softplus(a + dt_bias) (out2).
template <class It> void gdn_gates(const It& it, const EltArgs& a) {
  const int hv = a.heads, i = flat_index(it);
  if (i >= a.n * hv) return;
  const int r = i / hv, j = i % hv;
  a.out[i] = 1.0f / (1.0f + exp(-a.x[r * 2 * hv + j]));
  const float s = a.x[r * 2 * hv + hv + j] + a.u[j];
  a.out2[i] = a.w[j] * (s > 20.0f ? s : log1p_of(exp(s)));
}

template <class It> void gather_rows(const It& it, const EltArgs& a) {  // out[i] = x[idx[i]], rows of dim
  const int i = flat_index(it);
  if (i >= a.n * a.dim) return;
  a.out[i] = a.x[size_t(a.idx[i / a.dim]) * a.dim + i % a.dim];
}

}  // namespace swsycl

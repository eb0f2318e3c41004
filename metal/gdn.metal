// Pathwise Gated DeltaNet (docs/design.md "Pathwise GDN", "Exactness").
//
// gdn_conv   one simdgroup per (node, head unit): a unit is a q head, a k head or a v head of
//            the mixed channels. Causal depthwise conv along the node's path (taps reach into
//            the committed window), silu, and for q/k the L2 norm (q also scaled by 1/sqrt(dk)).
// gdn_recur  one threadgroup per value head; thread j owns state column j (dk floats in
//            registers). Folds the pending tape, then walks the tree in node order, each node
//            starting from its parent's state (registers when the parent is the previous node,
//            else node_state). Writes o and every node's state (for commit by selection).
// gdn_commit one threadgroup per value head: either select the leaf's state, or replay (fold)
//            the oldest tokens of pending ++ path into the committed state and keep the rest
//            as the new pending tape (at most max_pending, chosen by the host as n_fold).
// gdn_window the new conv window: the last K-1 inputs of window ++ x[path].
//
// Canonical order: conv taps t = 0..K-1 by fma; the L2 sum of squares as lane-strided fma then
// simd_sum; the recurrence reduces over the key dim i in order for each column j, exactly as
// the CPU kernel does. A node's state depends on its path only, so tree, chain and plain
// decoding agree bitwise, and folding a token (no output) updates the state with the same
// operations as verifying it.
#include <metal_stdlib>
#include "sw_common.h"
using namespace metal;

kernel void gdn_conv(device const float* x        [[buffer(0)]],  // [N, C] in_proj_qkv rows of the nodes
                     device const int* parents    [[buffer(1)]],  // [N]
                     device const float* window   [[buffer(2)]],  // [K-1, C] committed inputs, oldest first
                     device const float* conv_w   [[buffer(3)]],  // [K, C]
                     device float* q_out          [[buffer(4)]],  // [N, hk, dk]
                     device float* k_out          [[buffer(5)]],  // [N, hk, dk]
                     device float* v_out          [[buffer(6)]],  // [N, hv, dv]
                     constant SwGDNParams& p      [[buffer(7)]],
                     uint3 tg                     [[threadgroup_position_in_grid]],  // (node, unit)
                     uint lane                    [[thread_index_in_simdgroup]])
{
  const int i = tg.x, u = tg.y, K = p.conv_k;
  const int C = 2 * p.hk * p.dk + p.hv * p.dv;
  const bool is_q = u < p.hk, is_k = !is_q && u < 2 * p.hk;
  const int width = (is_q || is_k) ? p.dk : p.dv;
  const int base = (is_q || is_k) ? u * p.dk : 2 * p.hk * p.dk + (u - 2 * p.hk) * p.dv;

  // rows[t]: tap t's input; >= 0 a tree node, < 0 committed window row -1 - rows[t].
  int rows[SW_GDN_MAX_K];
  int node = i, w = K - 2;
  for (int t = K - 1; t >= 0; --t) {
    if (node >= 0) {
      rows[t] = node;
      node = parents[node];
    } else {
      rows[t] = -1 - w--;
    }
  }
  float y[SW_GDN_MAX_W / SW_SIMD];
  float ss = 0.0f;
  for (int e = 0; e * SW_SIMD < width; ++e) {
    const int cl = lane + SW_SIMD * e, c = base + cl;
    float acc = 0.0f;
    if (cl < width) {
      for (int t = 0; t < K; ++t) {
        const float xv = rows[t] >= 0 ? x[rows[t] * C + c] : window[(-1 - rows[t]) * C + c];
        acc = fma(conv_w[t * C + c], xv, acc);
      }
      acc = acc / (1.0f + exp(-acc));  // silu
    }
    y[e] = acc;
    ss = fma(acc, acc, ss);
  }
  device float* dst = is_q ? q_out + (i * p.hk + u) * p.dk
                    : is_k ? k_out + (i * p.hk + u - p.hk) * p.dk
                           : v_out + (i * p.hv + u - 2 * p.hk) * p.dv;
  if (is_q || is_k) {  // uniform over the simdgroup: u is the threadgroup's
    const float inv = rsqrt(simd_sum(ss) + 1e-6f);
    for (int e = 0; e * SW_SIMD < width; ++e)
      y[e] = is_q ? y[e] * inv * p.q_scale : y[e] * inv;
  }
  for (int e = 0; e * SW_SIMD < width; ++e)
    if (int(lane) + SW_SIMD * e < width) dst[lane + SW_SIMD * e] = y[e];
}

// One token on state column s (thread-private): S *= exp(g); u = S^T k; d = beta (v - u);
// S += k d^T; returns S^T q when with_q (k and q from threadgroup memory).
inline float gdn_step(thread float* s, threadgroup const float* kv, threadgroup const float* qv,
                      bool with_q, float vj, float g, float beta, int dk)
{
  const float eg = exp(g);
  float u = 0.0f;
  for (int i = 0; i < dk; ++i) {
    const float x = s[i] * eg;
    s[i] = x;
    u = fma(x, kv[i], u);
  }
  const float d = beta * (vj - u);
  float o = 0.0f;
  for (int i = 0; i < dk; ++i) {
    const float x = fma(kv[i], d, s[i]);
    s[i] = x;
    if (with_q) o = fma(x, qv[i], o);
  }
  return o;
}

inline int key_head(constant SwGDNParams& p, int h) {
  return p.grouped ? h / (p.hv / p.hk) : h % p.hk;
}

kernel void gdn_recur(device const float* state     [[buffer(0)]],   // [hv, dk, dv] committed
                      device const float* tape_k    [[buffer(1)]],   // [n_pending, hk, dk]
                      device const float* tape_v    [[buffer(2)]],   // [n_pending, hv, dv]
                      device const float* tape_g    [[buffer(3)]],   // [n_pending, hv]
                      device const float* tape_b    [[buffer(4)]],   // [n_pending, hv]
                      device const float* q         [[buffer(5)]],   // [N, hk, dk] from gdn_conv
                      device const float* k         [[buffer(6)]],   // [N, hk, dk]
                      device const float* v         [[buffer(7)]],   // [N, hv, dv]
                      device const float* g         [[buffer(8)]],   // [N, hv]
                      device const float* beta      [[buffer(9)]],   // [N, hv]
                      device const int* parents     [[buffer(10)]],  // [N]
                      device float* out             [[buffer(11)]],  // [N, hv, dv]
                      device float* node_state      [[buffer(12)]],  // [N, hv, dk, dv]
                      constant SwGDNParams& p       [[buffer(13)]],
                      threadgroup float* kq         SW_THREADGROUP_ARG(0),  // [2 * dk]: k | q
                      uint3 tg                      [[threadgroup_position_in_grid]],  // (value head)
                      uint tid                      [[thread_index_in_threadgroup]])
{
  const int h = tg.x, kh = key_head(p, h), dk = p.dk, dv = p.dv, j = tid;
  const bool live = j < dv;
  float s[SW_GDN_MAX_DK];
  for (int i = 0; i < dk; ++i) s[i] = live ? state[(h * dk + i) * dv + j] : 0.0f;

  for (int e = 0; e < p.n_pending; ++e) {
    if (j < dk) kq[j] = tape_k[(e * p.hk + kh) * dk + j];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (live) gdn_step(s, kq, kq + dk, false, tape_v[(e * p.hv + h) * dv + j], tape_g[e * p.hv + h],
                       tape_b[e * p.hv + h], dk);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  for (int i = 0; i < p.n_nodes; ++i) {
    const int par = parents[i];
    if (i > 0 && par != i - 1 && live)  // registers hold node i-1 (or the root for i == 0)
      for (int r = 0; r < dk; ++r) s[r] = node_state[((par * p.hv + h) * dk + r) * dv + j];
    const int slot = p.last_state_only ? 0 : i;
    if (j < dk) {
      kq[j] = k[(i * p.hk + kh) * dk + j];
      kq[dk + j] = q[(i * p.hk + kh) * dk + j];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (live) {
      out[(i * p.hv + h) * dv + j] =
          gdn_step(s, kq, kq + dk, true, v[(i * p.hv + h) * dv + j], g[i * p.hv + h], beta[i * p.hv + h], dk);
      if (!p.last_state_only || i == p.n_nodes - 1)
        for (int r = 0; r < dk; ++r) node_state[((slot * p.hv + h) * dk + r) * dv + j] = s[r];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

kernel void gdn_commit(device float* state            [[buffer(0)]],   // [hv, dk, dv], in place
                       device const float* tape_k     [[buffer(1)]],   // old pending tape
                       device const float* tape_v     [[buffer(2)]],
                       device const float* tape_g     [[buffer(3)]],
                       device const float* tape_b     [[buffer(4)]],
                       device const float* k          [[buffer(5)]],   // the verified tree's tape
                       device const float* v          [[buffer(6)]],
                       device const float* g          [[buffer(7)]],
                       device const float* beta       [[buffer(8)]],
                       device const int* path         [[buffer(9)]],   // [path_len]
                       device const float* node_state [[buffer(10)]],  // [N, hv, dk, dv]
                       device float* new_k            [[buffer(11)]],  // new pending tape
                       device float* new_v            [[buffer(12)]],
                       device float* new_g            [[buffer(13)]],
                       device float* new_b            [[buffer(14)]],
                       constant SwGDNParams& p        [[buffer(15)]],
                       threadgroup float* kbuf        SW_THREADGROUP_ARG(0),  // [dk]
                       uint3 tg                       [[threadgroup_position_in_grid]],  // (value head)
                       uint tid                       [[thread_index_in_threadgroup]])
{
  const int h = tg.x, kh = key_head(p, h), dk = p.dk, dv = p.dv, j = tid;
  const bool live = j < dv;
  if (p.select_leaf) {  // the leaf's state already folds the old pending tokens and the path
    const int leaf = path[p.path_len - 1];
    if (live)
      for (int r = 0; r < dk; ++r)
        state[(h * dk + r) * dv + j] = node_state[((leaf * p.hv + h) * dk + r) * dv + j];
    return;
  }
  float s[SW_GDN_MAX_DK];
  for (int r = 0; r < dk; ++r) s[r] = live ? state[(h * dk + r) * dv + j] : 0.0f;
  const int total = p.n_pending + p.path_len;
  for (int e = 0; e < p.n_fold; ++e) {  // token e of pending ++ path
    const bool old = e < p.n_pending;
    const int n = old ? e : path[e - p.n_pending];
    if (j < dk) kbuf[j] = old ? tape_k[(n * p.hk + kh) * dk + j] : k[(n * p.hk + kh) * dk + j];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (live) {
      const float vj = old ? tape_v[(n * p.hv + h) * dv + j] : v[(n * p.hv + h) * dv + j];
      const float gg = old ? tape_g[n * p.hv + h] : g[n * p.hv + h];
      const float bb = old ? tape_b[n * p.hv + h] : beta[n * p.hv + h];
      gdn_step(s, kbuf, kbuf, false, vj, gg, bb, dk);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (live)
    for (int r = 0; r < dk; ++r) state[(h * dk + r) * dv + j] = s[r];
  // The rest stays pending. Each key head's k is copied by its first value head only.
  const bool k_owner = p.grouped ? h % (p.hv / p.hk) == 0 : h < p.hk;
  for (int e = p.n_fold; e < total; ++e) {
    const bool old = e < p.n_pending;
    const int n = old ? e : path[e - p.n_pending], ne = e - p.n_fold;
    if (k_owner && j < dk)
      new_k[(ne * p.hk + kh) * dk + j] = old ? tape_k[(n * p.hk + kh) * dk + j] : k[(n * p.hk + kh) * dk + j];
    if (live) new_v[(ne * p.hv + h) * dv + j] = old ? tape_v[(n * p.hv + h) * dv + j] : v[(n * p.hv + h) * dv + j];
    if (j == 0) {
      new_g[ne * p.hv + h] = old ? tape_g[n * p.hv + h] : g[n * p.hv + h];
      new_b[ne * p.hv + h] = old ? tape_b[n * p.hv + h] : beta[n * p.hv + h];
    }
  }
}

kernel void gdn_window(device const float* window   [[buffer(0)]],  // [K-1, C]
                       device const float* x        [[buffer(1)]],  // [N, C]
                       device const int* path       [[buffer(2)]],  // [path_len]
                       device float* new_window     [[buffer(3)]],  // [K-1, C]
                       constant SwGDNParams& p      [[buffer(4)]],
                       uint3 tg                     [[threadgroup_position_in_grid]],
                       uint tid                     [[thread_index_in_threadgroup]])
{
  const int C = 2 * p.hk * p.dk + p.hv * p.dv, c = tg.x * SW_GDN_THREADS_W + tid, W = p.conv_k - 1;
  if (c >= C) return;  // no barrier follows
  for (int w = 0; w < W; ++w) {
    const int r = p.path_len + w;  // row of window ++ x[path]
    new_window[w * C + c] = r < W ? window[r * C + c] : x[path[r - W] * C + c];
  }
}

// Pathwise Gated DeltaNet, the SYCL twin of metal/gdn.metal (same four kernels, same canonical
// order; see that file's header).
#pragma once
#include "sw_sycl_common.hpp"

namespace swsycl {

// Work-group g (one sub-group) = (node g / U, unit g % U), U = 2 hk + hv head units.
template <class It>
void gdn_conv(const It& it, const GDNArgs& a) {
  const int U = 2 * a.hk + a.hv, g = int(it.get_group(0)), i = g / U, u = g % U;
  const int K = a.conv_k, C = 2 * a.hk * a.dk + a.hv * a.dv, lane = sg_lane(it);
  const bool is_q = u < a.hk, is_k = !is_q && u < 2 * a.hk;
  const int width = (is_q || is_k) ? a.dk : a.dv;
  const int base = (is_q || is_k) ? u * a.dk : 2 * a.hk * a.dk + (u - 2 * a.hk) * a.dv;

  int rows[kGDNMaxK];  // >= 0: tree node; < 0: committed window row -1 - rows[t]
  int node = i, w = K - 2;
  for (int t = K - 1; t >= 0; --t) {
    if (node >= 0) {
      rows[t] = node;
      node = a.parents[node];
    } else {
      rows[t] = -1 - w--;
    }
  }
  float y[kGDNMaxW / kSimd];
  float ss = 0.0f;
  for (int e = 0; e * kSimd < width; ++e) {
    const int cl = lane + kSimd * e, c = base + cl;
    float acc = 0.0f;
    if (cl < width) {
      for (int t = 0; t < K; ++t) {
        const float xv = rows[t] >= 0 ? a.x[rows[t] * C + c] : a.window[(-1 - rows[t]) * C + c];
        acc = fma(a.conv_w[t * C + c], xv, acc);
      }
      acc = acc / (1.0f + exp(-acc));  // silu
    }
    y[e] = acc;
    ss = fma(acc, acc, ss);
  }
  float* dst = is_q ? a.q + (i * a.hk + u) * a.dk
             : is_k ? a.k + (i * a.hk + u - a.hk) * a.dk
                    : a.v + (i * a.hv + u - 2 * a.hk) * a.dv;
  if (is_q || is_k) {  // uniform over the sub-group
    const float inv = rsqrt(sg_sum(it, ss) + 1e-6f);
    for (int e = 0; e * kSimd < width; ++e) y[e] = is_q ? y[e] * inv * a.q_scale : y[e] * inv;
  }
  for (int e = 0; e * kSimd < width; ++e)
    if (lane + kSimd * e < width) dst[lane + kSimd * e] = y[e];
}

// One token on a state column (see metal/gdn.metal gdn_step).
inline float gdn_step(float* s, const float* kv, const float* qv, bool with_q, float vj, float g,
                      float beta, int dk) {
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

inline int key_head(const GDNArgs& a, int h) { return a.grouped ? h / (a.hv / a.hk) : h % a.hk; }

// Work-group h = value head; work-item j owns state column j. kq: local [2 * dk].
template <class It>
void gdn_recur(const It& it, const GDNArgs& a, float* kq) {
  const int h = int(it.get_group(0)), kh = key_head(a, h), dk = a.dk, dv = a.dv;
  const int j = int(it.get_local_id(0));
  const bool live = j < dv;
  float s[kGDNMaxDK];
  for (int i = 0; i < dk; ++i) s[i] = live ? a.state[(h * dk + i) * dv + j] : 0.0f;

  for (int e = 0; e < a.n_pending; ++e) {
    if (j < dk) kq[j] = a.tape_k[(e * a.hk + kh) * dk + j];
    barrier(it);
    if (live) gdn_step(s, kq, kq + dk, false, a.tape_v[(e * a.hv + h) * dv + j], a.tape_g[e * a.hv + h],
                       a.tape_b[e * a.hv + h], dk);
    barrier(it);
  }
  for (int i = 0; i < a.n_nodes; ++i) {
    const int par = a.parents[i];
    if (i > 0 && par != i - 1 && live)  // registers hold node i-1 (or the root for i == 0)
      for (int r = 0; r < dk; ++r) s[r] = a.node_state[((par * a.hv + h) * dk + r) * dv + j];
    const int slot = a.last_state_only ? 0 : i;
    if (j < dk) {
      kq[j] = a.k[(i * a.hk + kh) * dk + j];
      kq[dk + j] = a.q[(i * a.hk + kh) * dk + j];
    }
    barrier(it);
    if (live) {
      a.out[(i * a.hv + h) * dv + j] = gdn_step(s, kq, kq + dk, true, a.v[(i * a.hv + h) * dv + j],
                                                a.g[i * a.hv + h], a.beta[i * a.hv + h], dk);
      if (!a.last_state_only || i == a.n_nodes - 1)
        for (int r = 0; r < dk; ++r) a.node_state[((slot * a.hv + h) * dk + r) * dv + j] = s[r];
    }
    barrier(it);
  }
}

// Work-group h = value head. kbuf: local [dk].
template <class It>
void gdn_commit(const It& it, const GDNArgs& a, float* kbuf) {
  const int h = int(it.get_group(0)), kh = key_head(a, h), dk = a.dk, dv = a.dv;
  const int j = int(it.get_local_id(0));
  const bool live = j < dv;
  if (a.select_leaf) {  // the leaf's state already folds the old pending tokens and the path
    const int leaf = a.path[a.path_len - 1];
    if (live)
      for (int r = 0; r < dk; ++r)
        a.state[(h * dk + r) * dv + j] = a.node_state[((leaf * a.hv + h) * dk + r) * dv + j];
    return;
  }
  float s[kGDNMaxDK];
  for (int r = 0; r < dk; ++r) s[r] = live ? a.state[(h * dk + r) * dv + j] : 0.0f;
  const int total = a.n_pending + a.path_len;
  for (int e = 0; e < a.n_fold; ++e) {  // token e of pending ++ path
    const bool old = e < a.n_pending;
    const int n = old ? e : a.path[e - a.n_pending];
    if (j < dk) kbuf[j] = old ? a.tape_k[(n * a.hk + kh) * dk + j] : a.k[(n * a.hk + kh) * dk + j];
    barrier(it);
    if (live) {
      const float vj = old ? a.tape_v[(n * a.hv + h) * dv + j] : a.v[(n * a.hv + h) * dv + j];
      const float gg = old ? a.tape_g[n * a.hv + h] : a.g[n * a.hv + h];
      const float bb = old ? a.tape_b[n * a.hv + h] : a.beta[n * a.hv + h];
      gdn_step(s, kbuf, kbuf, false, vj, gg, bb, dk);
    }
    barrier(it);
  }
  if (live)
    for (int r = 0; r < dk; ++r) a.state[(h * dk + r) * dv + j] = s[r];
  const bool k_owner = a.grouped ? h % (a.hv / a.hk) == 0 : h < a.hk;
  for (int e = a.n_fold; e < total; ++e) {
    const bool old = e < a.n_pending;
    const int n = old ? e : a.path[e - a.n_pending], ne = e - a.n_fold;
    if (k_owner && j < dk)
      a.new_k[(ne * a.hk + kh) * dk + j] = old ? a.tape_k[(n * a.hk + kh) * dk + j] : a.k[(n * a.hk + kh) * dk + j];
    if (live) a.new_v[(ne * a.hv + h) * dv + j] = old ? a.tape_v[(n * a.hv + h) * dv + j] : a.v[(n * a.hv + h) * dv + j];
    if (j == 0) {
      a.new_g[ne * a.hv + h] = old ? a.tape_g[n * a.hv + h] : a.g[n * a.hv + h];
      a.new_b[ne * a.hv + h] = old ? a.tape_b[n * a.hv + h] : a.beta[n * a.hv + h];
    }
  }
}

// New conv window: the last K-1 rows of window ++ x[path]; 256 work-items per group.
template <class It>
void gdn_window(const It& it, const GDNArgs& a) {
  const int C = 2 * a.hk * a.dk + a.hv * a.dv, W = a.conv_k - 1;
  const int c = int(it.get_group(0)) * int(it.get_local_range(0)) + int(it.get_local_id(0));
  if (c >= C) return;  // no barrier follows
  for (int w = 0; w < W; ++w) {
    const int r = a.path_len + w;
    a.new_window[w * C + c] = r < W ? a.window[r * C + c] : a.x[a.path[r - W] * C + c];
  }
}

}  // namespace swsycl

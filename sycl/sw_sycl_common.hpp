// Shared by the SYCL kernels (sycl/*.hpp), their op table (sycl_ops.hpp) and the emulator:
// limits, per-kernel argument blocks (device pointers + sizes, trivially copyable so a kernel
// lambda can capture them), and the traits layer that routes sub-group operations, barriers
// and math either to SYCL 2020 or to the emulator (SW_SYCL_EMU).
//
// Kernel bodies are templates over the item type: `template <class It> void k(const It& it, ...)`
// using it.get_local_id(0), it.get_group(0), it.get_local_range(0), it.get_group_range(0);
// everything else goes through swsycl:: below. One-dimensional nd_ranges only: the host
// linearises the group grid and the kernel decodes it. Sub-groups are 32 wide
// (reqd_sub_group_size(32) on every kernel), and a float sum over a sub-group is the explicit
// xor butterfly of sg_sum below, the same association on every device and in the emulator
// (sycl/README.md "Sub-groups and the canonical order").
#pragma once

#include <cstddef>
#include <cstdint>

namespace swsycl {
constexpr int kSimd = 32;  // the sub-group size every kernel requires and is written for
}

#ifdef SW_SYCL_EMU
#include "sycl_emu.hpp"  // emu/: emulated nd_item, sub-group collectives, barrier, math
#else
#include <sycl/sycl.hpp>
namespace swsycl {
template <class It> inline void barrier(const It& it) { sycl::group_barrier(it.get_group()); }
template <class It> inline int sg_lane(const It& it) { return int(it.get_sub_group().get_local_linear_id()); }
template <class It> inline int sg_index(const It& it) { return int(it.get_sub_group().get_group_linear_id()); }
template <class It> inline int sg_count(const It& it) { return int(it.get_sub_group().get_group_linear_range()); }
template <class It, class T> inline T sg_shuffle(const It& it, T x, int src_lane) {
  return sycl::select_from_group(it.get_sub_group(), x, src_lane);
}
template <class It, class T> inline T sg_shuffle_xor(const It& it, T x, int mask) {
  return sycl::permute_group_by_xor(it.get_sub_group(), x, mask);
}
template <class It, class T> inline T sg_max(const It& it, T x) {  // exact in any order
  return sycl::reduce_over_group(it.get_sub_group(), x, sycl::maximum<T>());
}
// The canonical sub-group sum: an xor butterfly over the 32 lanes (masks 16, 8, 4, 2, 1).
// Lane 0 computes ((x0 + x16) + (x8 + x24)) + ..., and every lane ends with the same bits (each
// step adds the same two values, in either order). Written out instead of reduce_over_group,
// whose association is the implementation's; emu/sycl_emu.hpp runs the same butterfly.
template <class It, class T> inline T sg_sum(const It& it, T x) {
  for (int m = kSimd / 2; m >= 1; m /= 2) x = x + sg_shuffle_xor(it, x, m);
  return x;
}
inline float exp(float x) { return sycl::exp(x); }
inline float log(float x) { return sycl::log(x); }
inline float sqrt(float x) { return sycl::sqrt(x); }
inline float bits_to_float(uint32_t b) { return sycl::bit_cast<float>(b); }
inline float fma(float a, float b, float c) { return sycl::fma(a, b, c); }
inline float rint(float x) { return sycl::rint(x); }
inline float rsqrt(float x) { return sycl::rsqrt(x); }
inline float fabs(float x) { return sycl::fabs(x); }
inline float fmax(float a, float b) { return sycl::fmax(a, b); }
inline float fmin(float a, float b) { return sycl::fmin(a, b); }
}  // namespace swsycl
#endif


namespace swsycl {

constexpr int kKVGroup = 32, kAttnTile = 32, kAttnMaxP = 4, kMaxHeadDim = 256;
constexpr int kGDNMaxDK = 128, kGDNMaxW = 256, kGDNMaxK = 8, kGDNWindowThreads = 256;
constexpr int kQ8MaxRows = 16, kQ8Threads = 256;
constexpr float kNegBig = -1.0e30f;  // "no key yet"; finite so fast-math builds stay exact

inline int imin(int a, int b) { return b < a ? b : a; }
inline int imax(int a, int b) { return a < b ? b : a; }
inline float clampf(float x, float lo, float hi) { return fmin(fmax(x, lo), hi); }

struct KVQuantArgs {  // x [T, Hkv, D] -> int8 pages [pages, Hkv, page_size, D] (+ scales)
  const float* x;
  int8_t* q_out;
  float* s_out;
  const int32_t* page_table;
  int n_tokens, n_kv_heads, head_dim, page_size, pos0;  // page_size 0: direct [T, Hkv, D]
};

struct AttnArgs {
  const float* q;                                   // [N, Hq, D]
  const int8_t *k_pages, *v_pages;                  // [pages, Hkv, page_size, D]
  const float *k_pscale, *v_pscale;                 // [pages, Hkv, page_size, D/32]
  const int32_t* page_table;
  const int8_t *k_tree, *v_tree;                    // [N, Hkv, D]
  const float *k_tscale, *v_tscale;                 // [N, Hkv, D/32]
  const int32_t* anc;                               // [N, anc_stride]
  const int32_t* row_len;                           // [N]
  float* part;                                      // [n_chunks, N, Hq, D + 2]
  float* out;                                       // [N, Hq, D] (merge)
  int n_rows, n_q_heads, n_kv_heads, head_dim, hist_len, page_size, split, n_chunks, anc_stride;
  float scale;
};

struct GDNArgs {
  const float *x, *window, *conv_w;                 // conv inputs: [N, C], [K-1, C], [K, C]
  const int32_t* parents;                           // [N]
  float *q, *k, *v;                                 // conv outputs / the tree's tape
  const float *g, *beta;                            // [N, hv]
  float* state;                                     // [hv, dk, dv] committed
  const float *tape_k, *tape_v, *tape_g, *tape_b;   // pending tape
  float* out;                                       // [N, hv, dv]
  float* node_state;                                // [N, hv, dk, dv]
  const int32_t* path;                              // commit
  float *new_k, *new_v, *new_g, *new_b, *new_window;
  int n_nodes, hk, hv, dk, dv, conv_k, grouped, n_pending, path_len, n_fold, select_leaf;
  float q_scale;
  int last_state_only;  // recur: a chain keeps only its last node's state, in slot 0
};

struct Q8Args {
  const float* x;            // [rows, cols]
  int8_t* xq;                // [rows, cols_pad]
  float* xs;                 // [rows]
  const int8_t* w;           // [out, cols_pad]
  const float* w_scale;      // [out]
  float* y;                  // [rows, out]
  int rows, cols, cols_pad, out_features;
};

}  // namespace swsycl

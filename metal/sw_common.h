// Shared by every .metal file, the GPU backend (csrc/gpu/) and the emulator (emu/):
// compile-time limits and the parameter blocks passed as `constant` buffers. Plain ints and
// floats only, so the layout is the same in MSL and in C++.
#pragma once

#ifndef SW_THREADGROUP_ARG
#define SW_THREADGROUP_ARG(i) [[threadgroup(i)]]
#endif

enum {
  SW_SIMD = 32,          // simdgroup width the kernels are written for
  SW_KV_GROUP = 32,      // dims sharing one int8 scale: one simdgroup per group
  SW_ATTN_TILE = 32,     // keys per tile, aligned to absolute positions
  SW_ATTN_MAXP = 4,      // (row, query head) pairs one simdgroup carries through a chunk
  SW_MAX_HEAD_DIM = 256,
  SW_GDN_MAX_DK = 128,   // a thread holds one state column of dk floats
  SW_GDN_MAX_W = 256,    // widest q/k/v head a conv simdgroup normalises
  SW_GDN_MAX_K = 8,      // conv taps
  SW_GDN_THREADS_W = 256,  // threads per gdn_window threadgroup
  SW_Q8_MAX_ROWS = 16,
  SW_Q8_THREADS = 256,   // 8 simdgroups per q8 threadgroup, one output channel each
  SW_Q4_GROUP = 64,      // q4 weights: inputs a run of 32 bytes, and a symmetric group (csrc/weights.h)
  SW_LSE_LANES = 256,    // logsumexp_rows: the fixed number of partial sums of a row
  SW_TOPK_MAX = 16,      // top_k_rows: k <= 16
  SW_NO_INDEX = 0x7fffffff,  // rows.metal: "no index yet", loses to every real one
};

// Attention scores are finite; this sentinel stands for "no key yet" without relying on
// infinities (fast-math builds may assume there are none). exp(sentinel - s) == 0.
#define SW_NEG_BIG (-1.0e30f)

// kv_quantize: x [T, Hkv, D] -> pages [pages, Hkv, page_size, D] (+ scales [.., D/32]).
// Token t goes to position pos0 + t through page_table; page_size == 0 means "direct": token t
// is row t of a [T, Hkv, D] buffer (the tree nodes' own keys and values).
struct SwKVQuantParams {
  int n_tokens, n_kv_heads, head_dim, page_size, pos0;
};

// tree_attn_partial / tree_attn_merge (see tree_attention.metal).
struct SwAttnParams {
  int n_rows, n_q_heads, n_kv_heads, head_dim;
  int hist_len, page_size, split, n_chunks, anc_stride;
  float scale;
};

// gdn_conv / gdn_recur / gdn_commit / gdn_window (see gdn.metal).
struct SwGDNParams {
  int n_nodes, hk, hv, dk, dv, conv_k;
  int grouped;       // 1: value head h reads key head h / (hv/hk); 0 (tiled): h % hk
  int n_pending;     // committed-but-unfolded tokens on the tape
  int path_len, n_fold, select_leaf;  // commit only
  float q_scale;     // 1/sqrt(dk)
  // recur: the nodes are a chain committed as they go (a prefill chunk): keep only the last
  // node's state, in slot 0, instead of every node's (no node's state is read back)
  int last_state_only;
};

// q8_quantize_rows / q8_matmul (q8_matmul.metal), matmul_f32 / matmul_bf16 (matmul.metal):
// the one matmul parameter block. cols_pad is the int8 row stride (q8: a multiple of 32, q4: of
// 64); the float matmuls read rows of `cols`.
struct SwQ8Params {
  int rows, cols, cols_pad, out_features;
};

// q4_matmul: SwQ8Params' rows, cols_pad and out_features, and the weights' groups (QMatrix's
// `group` and affine()): group = inputs a scale, SW_Q4_GROUP (64) or 32 (affine only);
// affine = 1: a bias a group too, the weight scale * q + bias with q the nibble itself;
// 0: symmetric, (q - 8) * scale.
struct SwQ4Params {
  int rows, cols_pad, out_features, group, affine;
};

// elementwise.metal: n is the element count (add_inplace, silu_mul, sigmoid_mul) or the row
// count (split_q_gate: heads = Hq, dim = D; rope: heads, dim = head_dim, rot = rotary dims;
// gdn_gates: heads = Hv; gather_rows: dim = row width in floats).
struct SwEltParams {
  int n, heads, dim, rot;
};

// embed_rows_*: tokens [n_tokens] -> x [n_tokens, hidden] from a [vocab, hidden] table
// (q8/q4: rows of cols_pad int8 / cols_pad / 2 bytes). group, affine: embed_rows_q4's groups as
// SwQ4Params' (the other formats leave them 0).
struct SwEmbedParams {
  int n_tokens, hidden, cols_pad, vocab, group, affine;
};

// rows.metal: rms_norm (cols = dim, eps), argmax_rows / logsumexp_rows / top_k_rows (k).
struct SwRowsParams {
  int rows, cols, k;
  float eps;
};

// Host-side launch planning for tree attention: the GPU backend's (csrc/gpu/gpu_state.cpp), the
// same on every device. C++ only.
//
// From parents: each row's depth, its root-to-node path (anc[i][d] = the node at depth d on
// row i's path) and row_len[i] = hist_len + depth + 1 keys. Rows go in blocks of at most
// 32 * SW_ATTN_MAXP (row, query head) pairs; a block's chunk count and simdgroup count follow
// from its rows. None of this changes any row's arithmetic (see tree_attention.metal).
#pragma once
#include <cstdint>

#include "sw_common.h"

struct SwAttnPlan {
  int n_rows, stride, grp, rows_per_block;
};

// depth, anc and row_len are caller buffers of n, n * n and n ints. max_simdgroups: what the
// pipeline allows per threadgroup (maxTotalThreadsPerThreadgroup / 32; 32 in the emulator).
// Returns 0, or -1 when parents is not a topologically ordered tree rooted at node 0.
inline int sw_attn_plan(const int32_t* parents, int n, int hist_len, int n_q_heads, int n_kv_heads,
                        int max_simdgroups, int32_t* depth, int32_t* anc, int32_t* row_len,
                        SwAttnPlan* plan) {
  int max_depth = 0;
  for (int i = 0; i < n; ++i) {
    if (i == 0 ? parents[0] != -1 : (parents[i] < 0 || parents[i] >= i)) return -1;
    depth[i] = i == 0 ? 0 : depth[parents[i]] + 1;
    if (depth[i] > max_depth) max_depth = depth[i];
  }
  plan->n_rows = n;
  plan->stride = max_depth + 1;
  plan->grp = n_q_heads / n_kv_heads;
  const int rows = max_simdgroups * SW_ATTN_MAXP / plan->grp;
  plan->rows_per_block = rows > 0 ? rows : 1;  // grp > 32 * MAXP is refused by the host
  for (int i = 0; i < n; ++i) {
    for (int k = i; k >= 0; k = parents[k]) anc[i * plan->stride + depth[k]] = k;
    row_len[i] = hist_len + depth[i] + 1;
  }
  return 0;
}

// Rows [r0, r0 + *nr) form the next block: its chunk count and simdgroups per threadgroup.
inline void sw_attn_block(const SwAttnPlan& plan, const int32_t* row_len, int r0, int split, int* nr,
                          int* n_chunks, int* nsg) {
  *nr = plan.n_rows - r0 < plan.rows_per_block ? plan.n_rows - r0 : plan.rows_per_block;
  int max_len = 0;
  for (int i = r0; i < r0 + *nr; ++i) max_len = row_len[i] > max_len ? row_len[i] : max_len;
  *n_chunks = (max_len + split - 1) / split;
  *nsg = (*nr * plan.grp + SW_ATTN_MAXP - 1) / SW_ATTN_MAXP;
}

// Threadgroup memory of tree_attn_partial: int8 K and V tiles plus their scales.
inline int sw_attn_smem_bytes(int head_dim) { return 72 * head_dim; }

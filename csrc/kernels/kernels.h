// The CPU kernel interface. Each kernel body is compiled once per instruction set (generic,
// AVX2, AVX-512 VNNI, AMX) from the same source; reductions run in an order fixed by positions and
// dims only and vectorise across independent lanes, so every variant gives the same bits.
#pragma once
#include <cstdint>

#include "../kv_cache.h"
#include "../weights.h"

namespace sapwood {

// Tree attention, rows are query nodes. Row i sees positions [0, row_len[i]); a position
// p < hist_len comes from the sequence's pages, p >= hist_len from tree node
// anc[i * anc_stride + (p - hist_len)] of k_tree / v_tree (already int8-roundtripped). An int8
// pool's scores take int8 queries against the keys' int8 form (tree_attention_q8.inc): for the
// tree nodes that is kq_tree / ks_tree, quantize_int8 of the same keys the pages would store.
struct AttnProblem {
  int n_rows, n_q_heads, n_kv_heads, head_dim;
  const float* q;        // [n_rows][n_q_heads][head_dim], rotary applied
  float* out;            // [n_rows][n_q_heads][head_dim]
  const int* row_len;    // [n_rows]
  int hist_len;
  const KVSequence* seq;
  int layer;
  const float* k_tree;   // [n_tree][n_kv_heads][head_dim]
  const float* v_tree;
  const int* anc;
  int anc_stride;
  int split;             // positions per split-K chunk, a multiple of kAttnTile
  float scale;
  const int8_t* kq_tree = nullptr;  // [n_tree][n_kv_heads][head_dim] (int8 pools)
  const float* ks_tree = nullptr;   // [n_tree][n_kv_heads][head_dim / 32]
};
constexpr int kAttnTile = 32;       // keys per tile; tiles are aligned to absolute positions
constexpr int kAttnRowBlock = 16;   // rows whose partials are held at once
constexpr int kAttnSplit = 512;     // the engine's fixed split-K chunk (a node's bits depend on it)

// Pathwise GDN for one layer. Node i's conv inputs are its K-1 predecessors on its path
// (reaching into the committed window) then itself.
struct GDNDims {
  int hk, hv, dk, dv, conv_k;
  bool tiled;  // value head h reads key head h % hk (tiled) or h / (hv/hk) (grouped)
  int channels() const { return 2 * hk * dk + hv * dv; }
  int key_head(int h) const { return tiled ? h % hk : h / (hv / hk); }
};

struct GDNConvProblem {
  GDNDims dims;
  int n;                  // nodes
  const float* x;         // [n][C] pre-conv inputs
  const int* parents;     // [n]; -1 = reads the committed window
  const float* window;    // [conv_k-1][C], oldest first
  const float* conv_w;    // [conv_k][C] (transposed from HF [C,1,K])
  float* q;               // [n][hk][dk] normalised and scaled by dk^-0.5
  float* k;               // [n][hk][dk] normalised
  float* v;               // [n][hv][dv]
};

struct GDNTreeProblem {
  GDNDims dims;
  int n;
  const int* parents;
  const float *q, *k, *v;     // from GDNConvProblem
  const float* g;             // [n][hv] log decay
  const float* beta;          // [n][hv]
  float* state;               // [hv][dk][dv]: in = committed S, out = S with pending folded
  int n_pending;
  const float *pk, *pv, *pg, *pbeta;  // pending tape [n_pending][...] (k [hk][dk])
  float* out;                 // [n][hv][dv]
  bool in_place_chain;        // prefill: nodes form a chain and S ends at the last node
};

// y [n][w.rows] = x [n][w.cols] W^T; Q8/Q4 read `acts` (x quantized per row) instead of x.
constexpr int kMaxMatmuls = 3;  // q|k|v
struct MatmulProblem {
  const QMatrix* w;
  const float* x;
  const QActs* acts;
  int n;
  float* y;
};

struct KernelTable {
  const char* name;
  void (*tree_attention)(const AttnProblem&, int threads);
  void (*gdn_conv)(const GDNConvProblem&, int threads);
  void (*gdn_tree)(const GDNTreeProblem&, int threads);
  // y_i = x W_i^T for `count` (1..kMaxMatmuls) problems sharing x, n, acts and the weights'
  // format and width, in one parallel region
  void (*matmul)(const MatmulProblem* problems, int count, int threads);
  // out[i] = silu(x[i]) * u[i] (u null: silu(x[i])), silu from the canonical exp of math.inc;
  // out may alias x or u
  void (*silu_mul)(const float* x, const float* u, float* out, size_t n);
  // the same with the sigmoid 1 / (1 + exp(-x)) (the attention output gate)
  void (*sigmoid_mul)(const float* x, const float* u, float* out, size_t n);
  // max(x) + log(sum exp(x - max)), from the canonical exp in a fixed lane order
  double (*logsumexp)(const float* x, size_t n);
  // RMSNorm of n rows of dim (out may alias x): fmaf sum of squares in order, (x * inv) * w
  void (*rms_norm)(const float* x, const float* w1, int n, int dim, float eps, float* out);
  // quantize_block (common.h) of one row: returns the scale
  float (*quantize_row)(const float* x, int n, float qmax, int8_t* q);
  // the first index of the largest non-NaN x[i] (0 when there is none)
  int (*argmax)(const float* x, size_t n);
  // the k best ids other than `skip` (-1: none), best first, an equal value's lower id first;
  // NaNs never enter (out[0..k) must have room: k <= n, or n - 1 with skip in range)
  void (*top_ids)(const float* x, int n, int k, int skip, int* out);
  // `iters` rounds of this variant's int8 peak microkernel (peak.inc) on the calling thread:
  // returns the multiply-adds done (benchmarks' compute roof); writes a result to sink[0]
  long long (*int8_peak)(long long iters, int32_t* sink);
};

// The variant in use: best supported, or forced by SAPWOOD_ISA=generic|avx2|avx512|amx.
const KernelTable& kernels();
const KernelTable* kernels_by_name(const char* name);  // nullptr when absent/unsupported
void set_kernels(const KernelTable* table);            // tests compare variants bitwise

}  // namespace sapwood

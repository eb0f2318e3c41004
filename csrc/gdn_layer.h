// Committed state of one Gated DeltaNet layer and the tape of the last verify.
//
// Committed = S [hv][dk][dv] + conv window [K-1][C] + up to max_pending "pending" tokens whose
// (k, v, g, beta) were committed but not yet folded into S. verify() folds the pending tokens
// into S (the committed state it stands for is unchanged), runs the tree from it and keeps
// every node's (x, k, v, g, beta). commit(path) selects: pending <- the path's tokens, folding
// the oldest beyond max_pending. Per-node states are never retained (48 heads x 64 KiB each
// would be 3 MiB a node a layer); the tape costs one recurrence step per committed token.
#pragma once
#include <vector>

#include "kernels/kernels.h"

namespace sapwood {

class GDNLayer {
 public:
  // conv_w: [C][K] (HF conv1d.weight [C,1,K] squeezed).
  GDNLayer(const GDNDims& dims, const float* conv_w, int max_pending = 8);

  const GDNDims& dims() const { return dims_; }
  // x [n][C], g [n][hv], beta [n][hv] -> out [n][hv][dv]. Committed state unchanged.
  void verify(const float* x, const float* g, const float* beta, const int* parents, int n,
              float* out, int threads);
  void commit(const std::vector<int>& path, int threads);
  // Commit n tokens as a chain in one go (prompt processing), writing their outputs.
  void prefill(const float* x, const float* g, const float* beta, int n, float* out, int threads);
  void reset();

  // The committed state alone (no weights, no tape): what a caller saves to roll back a
  // prefill (the draft chain, a failed prefill) at a fraction of copying the layer.
  struct Committed {
    std::vector<float> S, window, pk, pv, pg, pbeta;
    int n_pending = 0;
  };
  // save copies into *c's buffers (no allocation once they have grown); restore swaps them
  // in, leaving *c with buffers to save into next time.
  void save(Committed* c) const;
  void restore(Committed* c);

  // One token as the pending tape holds it, with its conv input: what a draft chain keeps per
  // row (a few KiB against the whole state), so that adopting its first rows appends them as
  // pending tokens, as commit does, instead of copying a state per row.
  struct Token {
    std::vector<float> k, v, g, beta, x;
  };
  // After prefill: its row i, whose conv input must still be in the window (the last K-1
  // rows), copied into *t's buffers.
  void token(int i, Token* t) const;
  // Commit tokens as pending (after restore() to the state they followed); bitwise the state
  // prefill of the same tokens leaves, as folding a pending token is the chain's recurrence.
  void append_pending(const Token* const* tokens, int m, int threads);
  // Fold every pending token into S (the committed state it stands for is unchanged).
  void fold_pending(int threads) {
    if (n_pending_ > 0) fold_oldest(n_pending_, threads);
  }

  // S with every pending token folded in (what the state "is"); for tests and snapshots.
  std::vector<float> folded_state(int threads) const;
  const std::vector<float>& raw_state() const { return S_; }
  const std::vector<float>& window() const { return window_; }
  int n_pending() const { return n_pending_; }
  size_t state_bytes() const;

 private:
  void conv(const float* x, const int* parents, int n, int threads);
  void run_tree(float* state, const int* parents, int n, float* out, bool chain, int n_pending,
                int threads);
  void fold_oldest(int count, int threads);
  void push_pending(const float* k, const float* v, const float* g, const float* beta);
  // window <- the last K-1 rows of the window followed by `rows` (C floats each, in order)
  void slide_window(const std::vector<const float*>& rows);

  GDNDims dims_;
  int max_pending_;
  std::vector<float> conv_w_t_;             // [K][C]
  std::vector<float> S_, window_;           // committed
  std::vector<float> window_next_;          // slide_window's scratch
  std::vector<float> pk_, pv_, pg_, pbeta_; // pending tape, max_pending (+ tree) tokens
  int n_pending_ = 0;
  // tape of the last verify
  int tape_n_ = 0;
  std::vector<int> tape_parents_;
  std::vector<float> x_, q_, k_, v_, g_, beta_;
};

}  // namespace sapwood

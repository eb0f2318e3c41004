// The Qwen3.5 dense hybrid model: dims, weights in the chosen format, and the forward pass of
// a batch of rows (a prompt chunk or a tree) against committed state owned by the Engine.
#pragma once
#include <map>
#include <string>
#include <array>
#include <initializer_list>
#include <utility>
#include <vector>

#include "gdn_layer.h"
#include "kv_cache.h"
#include "weight_source.h"
#include "weights.h"

namespace sapwood {
struct Act;
}

namespace sapwood {

struct ModelDims {
  int vocab = 0, hidden = 0, inter = 0;
  std::vector<bool> is_attn;          // per layer: full attention (else GDN)
  int n_heads = 0, n_kv_heads = 0, head_dim = 0, rotary_dim = 0;
  float rope_theta = 10000.0f, eps = 1e-6f;
  bool tied = false;
  int hk = 0, dk = 0, hv = 0, dv = 0, conv_k = 4;
  bool tiled = false;
  int n_layers() const { return int(is_attn.size()); }
  int n_attn() const;
  GDNDims gdn() const { return GDNDims{hk, hv, dk, dv, conv_k, tiled}; }
  int conv_dim() const { return 2 * hk * dk + hv * dv; }
};

struct LayerWeights {
  std::vector<float> in_norm, post_norm;   // stored as (1 + w): zero-centred RMSNorm
  QMatrix gate, up, down;
  // GDN
  QMatrix qkv, z, out;
  QMatrix ba;                              // in_proj_b | in_proj_a rows, always f32 (tiny)
  std::vector<float> conv_w, dt_bias, neg_exp_a, gnorm;
  // attention
  QMatrix q, k, v, o;
  std::vector<float> q_norm, k_norm;       // (1 + w)
  // every matrix (the mixer a layer does not have is empty)
  std::array<const QMatrix*, 11> matrices() const {
    return {&gate, &up, &down, &qkv, &z, &out, &ba, &q, &k, &v, &o};
  }
};

struct ModelWeights {
  QMatrix embed, lm_head;                  // lm_head empty when tied
  std::vector<float> final_norm;           // (1 + w)
  std::vector<LayerWeights> layers;
  size_t bytes() const;
  long long macs_per_token() const;  // a token's matmul multiply-adds, LM head included
  const QMatrix& head() const { return lm_head.rows ? lm_head : embed; }  // the LM head
};

ModelWeights load_weights(const ModelDims& d, WeightLoader& t, WFormat fmt);
// One decoder layer's weights under `prefix` ("model.layers.3.", "mtp.layers.0."): full
// attention when `attn`, else GDN. Missing or misshapen tensors throw naming the tensor.
LayerWeights load_layer(const ModelDims& d, WeightLoader& t, const std::string& prefix, bool attn,
                        WFormat fmt);
// A named tensor of exactly `shape`, checked; its values as (1 + w) (zero-centred RMSNorm).
std::vector<float> load_norm(WeightLoader& t, const std::string& name, int dim);

// Where a batch of rows sits: row i at absolute position pos[i]. Attention keys of positions
// < hist_len come from pages; >= hist_len from this batch's rows via anc (see AttnProblem).
struct BatchLayout {
  int n = 0;
  std::vector<int> pos, row_len, parents, anc;
  int anc_stride = 0, hist_len = 0;
  bool prefill = false;   // rows are a chain committed as they go (K/V written to pages first)
};

// A prefill chunk: n rows at positions [P, P + n), a chain committed as it goes.
BatchLayout prefill_layout(int P, int n);
// A tree verified against P committed positions (parents checked: one root, parents first).
BatchLayout tree_layout(int P, const std::vector<int>& parents);

class Backend;

// One sequence's part of a forward: its state (a backend) and where its rows sit.
struct SeqRows {
  Backend* be;
  const BatchLayout* lay;
};

// The forward pass of docs/design.md, written once over the backend's op list and state.
class Forward {
 public:
  Forward(const ModelDims& d, const ModelWeights& w) : d_(d), w_(w) {}
  Forward(const Forward&) = delete;  // holds its engine's dims and weights by reference
  Forward& operator=(const Forward&) = delete;
  // Runs the rows through every layer and appends the logits of rows [logit_from, n)
  // ([n - logit_from][V]) to *logits: a draft chain collects its rows in one buffer.
  // `hidden` (if given) receives the final-normed rows [n][H] (what the LM head reads), for
  // drafters that read the target's hidden states (the MTP head); the logits are the same bits.
  // Returns the logits rows in the backend's memory (kLogits, until the next forward); with
  // logits null they stay there, not downloaded: the caller's next download is the sync point.
  Act run(Backend& be, const int* tokens, const BatchLayout& lay, int logit_from,
          std::vector<float>* logits, std::vector<float>* hidden = nullptr);
  // The decoder layers alone over rows x [n][H] (in place), RoPE at lay.pos: what run() does
  // between the embedding and the final norm (the MTP head feeds its own rows in).
  void run_layers(Backend& be, Act x, const BatchLayout& lay);
  // Several sequences' trees in one forward (verify layouts): the rows of parts[i] follow
  // those of parts[i - 1]. The stateless ops (every matmul among them) run on `ops`, a sibling
  // of every part's backend (Backend::new_sequence), over all rows at once, so each weight
  // matrix is read once for all of them; each part's attention and GDN layers run over its own
  // state and layout, so rows of different parts never see each other. The matmuls are
  // row-independent (docs/design.md "Exactness"): a part's logits [n][V] (appended in part order to
  // *logits, [total][V]) and hidden rows are the bits run() gives it alone.
  void run_forest(Backend& ops, const std::vector<SeqRows>& parts, const int* tokens,
                  std::vector<float>* logits, std::vector<float>* hidden = nullptr);

  // Activations, kept by the backend from one forward to the next (an engine runs one at a
  // time; fresh buffers per forward cost malloc, free and zeroing); every buffer is written in
  // full before it is read.
  enum Buf { kX, kH, kMix, kGate, kUp, kQKV, kZ, kBA, kBeta, kDecay, kO, kQG, kQ, kAttGate,
             kAtt, kRope, kLogits, kForestK, kForestV, kDraftPick, kBufs };

 private:
  // The rows of one forward: n in all, at positions pos, split into parts (one for run()).
  struct Rows {
    int n;
    const std::vector<int>& pos;
    const std::vector<SeqRows>& parts;
  };
  Act forward(Backend& be, const int* tokens, const Rows& r, int logit_from,
              std::vector<float>* logits, std::vector<float>* hidden);
  void layers(Backend& be, Act x, const Rows& r);
  void gdn_mixer(Backend& be, int l, int g, Act h, const Rows& r, Act out);
  void attn_mixer(Backend& be, int l, int a, Act h, const Rows& r, Act out);

  const ModelDims& d_;
  const ModelWeights& w_;
  std::vector<float> rope_cs_;  // this forward's RoPE (cos, sin): [row][rotary_dim / 2][2]
};

}  // namespace sapwood

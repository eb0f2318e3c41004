// The checkpoint's multi-token-prediction head (`mtp.*`) as a drafter, as vLLM's qwen3_5_mtp
// defines it. For the target's final hidden state h_i (after model.norm) and the next token
// t_{i+1}:
//     x = fc([pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])
// then one full-attention decoder layer at position i (the target's attention and MLP math,
// with its own KV cache), mtp.norm, and the target's LM head (tied or not). Deeper rows feed
// the head's own output hidden state (after mtp.norm) and its pick back in.
//
// The head runs over its own backend instance (make_backend, sized for its one attention
// layer, of the target's kind) so every backend that runs the target runs it too; it reads the
// target engine's embedding table and LM head (the engine must outlive it), which a device
// backend copies into its own buffers (Backend::add_weights). Its committed rows are the target's
// committed positions: the caller hands it the target's hidden rows (Engine::take_hidden) and
// the tokens after them as the target commits them; drafting rolls its own rows back.
//
// One call at a time (exclusive.h): a second thread gets EngineBusy, as on an Engine; several
// threads corrupted the head's backend state and the heap (issue 50). What it reads of the
// target engine (embedding table, LM head) is immutable once loaded, so the head and its
// target run side by side on two threads; the drafter pairs them, and each guards its own
// state.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "engine.h"
#include "exclusive.h"
#include "model.h"

namespace sapwood {

class MtpHead {
 public:
  // Tensors named as in the checkpoint under "mtp." (fc, pre_fc_norm_embedding,
  // pre_fc_norm_hidden, norm, layers.0.*), shape-checked here as well.
  MtpHead(const Engine& target, TensorSource& t, WFormat wfmt, KVDtype kv, int max_context,
          int threads, int page_size = 64, const std::string& backend = "cpu");

  // Commit rows at positions [position(), +n): hidden [n][H] the target's final hidden rows,
  // tokens [n] the token after each. Returns the logits of every row ([n][V]) or of the last
  // ([V]); `out_hidden` (if given) receives the head's output rows [n][H] (after mtp.norm).
  std::vector<float> prefill(const std::vector<float>& hidden, const std::vector<int>& tokens,
                             bool all_rows, std::vector<float>* out_hidden = nullptr);
  // Commit the rows as prefill() does (at least one: the last is the root's, its token the
  // root), then draft `rows` rows: row 0 is the last committed row's prediction, row r > 0 the
  // head run on row r-1's output hidden and pick at the next position, rolled back after.
  // Picks as Engine::draft_chain (argmax, or the keyed sample of the token at key_position + r,
  // key_position being the absolute position of the token row 0 predicts); ranked as
  // Engine::draft_candidates: ids, logp [rows][k]; logits (if given) gets the rows [rows][V].
  void draft(const std::vector<float>& hidden, const std::vector<int>& tokens, int rows, int k,
             double temperature, uint64_t seed, uint64_t key_position, std::vector<int>* ids,
             std::vector<double>* logp, std::vector<float>* logits = nullptr);

  // A drafter's round in one call: take the target's hidden rows kept since the last take
  // (Engine::take_hidden), join them to the rows not yet committed here (after a gap, start
  // over at the first row there is), then draft() with the token after each row: `tail` holds
  // the target's context from position tail_start to its end. Returns false, drafting
  // nothing, when there is no row to draft from, or, with *need set, when the tail starts
  // after the first token needed (call again with the context from *need).
  bool draft_target(Engine& target, const std::vector<int>& tail, int tail_start, int root,
                    int rows, int k, double temperature, uint64_t seed, std::vector<int>* ids,
                    std::vector<double>* logp, int* need);

  int position() const {
    Exclusive::Use use(exclusive_, kBusy);
    return be_->length();
  }
  int max_context() const { return max_context_; }
  int hidden_size() const { return dims_.hidden; }
  int vocab_size() const { return dims_.vocab; }
  void reset() {
    Exclusive::Use use(exclusive_, kBusy);
    be_->reset();
    from_ = 0;
    pending_.clear();
  }
  size_t weight_bytes() const;

 private:
  static constexpr const char* kBusy =
      "MTP head is in use by another thread: an MtpHead runs one call at a time (give each "
      "thread its own, e.g. Model.new_sequence(), or serialise the calls)";
  Exclusive exclusive_;

  // One forward over rows committed as they go (positions from position()); logits of rows
  // [logit_from, n) appended to *logits (null: left in the backend, returned), their output
  // hidden rows to *out_hidden.
  Act forward(const float* hidden, const int* tokens, int n, int logit_from,
              std::vector<float>* logits, std::vector<float>* out_hidden);
  void check_rows(const std::vector<float>& hidden, const std::vector<int>& tokens) const;

  const ModelWeights& target_;  // embedding table and LM head
  ModelDims dims_;              // the target's, with one full-attention layer
  ModelWeights weights_;        // the head's layer; final_norm = mtp.norm
  std::vector<float> pre_e_, pre_h_;
  QMatrix fc_e_, fc_h_;         // fc's columns for the embedding and for the hidden half
  int max_context_, threads_;
  Forward fwd_;
  std::unique_ptr<Backend> be_;
  int from_ = 0;                // draft_target: the target position of pending_'s first row
  std::vector<float> pending_;  // the target's hidden rows not yet committed here [n][H]
};

}  // namespace sapwood

// The Engine of docs/design.md: committed state (paged KV + GDN layers) and the three calls
// prefill / verify / commit, plus snapshots of the committed state.
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "backend.h"
#include "exclusive.h"
#include "model.h"
#include "sampler.h"
#include "thread_pool.h"

namespace sapwood {

// A drafter's pick from a row of logits [V] for the token at `position`: the argmax (ties:
// lower id) at temperature 0, else the sampler's keyed Gumbel-max sample among the `top` best.
int draft_pick(const float* row, int V, double temperature, uint64_t seed, uint64_t position,
               int top);
// Per row of z [rows][V]: chain[r] first, then the k-1 other most likely ids (ties: lower id),
// with their log-probabilities under the row's softmax; ids and logp [rows][k].
void rank_draft_rows(const float* z, int rows, int V, int k, const std::vector<int>& chain,
                     std::vector<int>* ids, std::vector<double>* logp);
// A greedy row ranked where its logits y [V] are (Backend::top_k_rows and logsumexp_rows, one
// download of 2k + 1 values, no host pass over the vocabulary): its k candidates appended to
// ids and logp as rank_draft_rows gives them (the log-sum-exp in float), and the pick, the
// first of them (the first max, as argmax). k <= Backend::kMaxTopK.
int rank_row_on_backend(Backend& be, Act y, int V, int k, std::vector<int>* ids,
                        std::vector<double>* logp);

// What the sequences of one model share (Engine::new_sequence): its dims, its weights and
// their identity. Immutable once built.
struct SharedModel {
  ModelDims dims;
  ModelWeights weights;
  uint64_t model_id = 0;
};

class Engine {
 public:
  Engine(const ModelDims& dims, TensorSource& weights, WFormat wfmt, KVDtype kv,
         int max_context, int threads, int page_size = 64, const std::string& backend = "cpu");
  // Another sequence of `base`'s model: its weights (and a GPU backend's device and uploaded
  // weights) shared, its own empty state; max_context and threads as given (0: base's).
  // Snapshots move between the two (the same model id and backend).
  Engine(const Engine& base, int max_context, int threads);
  // Whether two engines run one copy of the weights (one is the other's new_sequence, or both
  // of a third's).
  bool shares_weights(const Engine& other) const { return model_ == other.model_; }
  // Verify the trees of several sequences of one model (engines sharing weights, each at most
  // once) in one forward (Forward::run_forest): each weight matrix is read once for all their
  // rows. Each engine's logits [N_i][V] are the bits its own verify(tokens[i], parents[i])
  // gives, and each then commits a path of its tree as after verify(). At most
  // kMaxVerifyNodes nodes in all. Every engine is checked before any state changes. The
  // forward runs on the engines' threads together (each one's caller waits for it).
  static std::vector<std::vector<float>> verify_many(const std::vector<Engine*>& engines,
                                                     const std::vector<std::vector<int>>& tokens,
                                                     const std::vector<std::vector<int>>& parents);

  // Commit tokens; logits of the last row [V], or of every row [T][V].
  std::vector<float> prefill(const std::vector<int>& tokens, bool all_rows);
  // Score a tree (node 0 = root at position P); committed state unchanged. [N][V].
  std::vector<float> verify(const std::vector<int>& tokens, const std::vector<int>& parents);
  // verify(tokens, parents), then the walk over its logits (sampler.h walk_tree: the pick at
  // each node of the path at its position, keyed sampling or argmax), then, if `commit`,
  // commit(path, fold_in_background): a round in one call, the logits left in the engine
  // unless `logits` asks for them ([N][V]).
  // masks: null, or one allowed-token row per node (sampler.h mask_words(V) words each).
  Walk verify_walk(const std::vector<int>& tokens, const std::vector<int>& parents,
                   const SampleParams& p, bool commit, bool fold_in_background = false,
                   std::vector<float>* logits = nullptr, const uint32_t* masks = nullptr);
  // fold_in_background: fold the committed GDN steps (which the next verify would fold
  // first) on a pool worker while the caller goes on, e.g. drafting on its own thread; the
  // next call that touches the GDN state waits for it. The same bits either way.
  void commit(const std::vector<int>& path, bool fold_in_background = false);
  ~Engine();
  // Self-draft: logits [rows][V] along the chain root, a1, a2, ... where a(r+1) is picked from
  // row r: its argmax (ties: lower id) at temperature 0, else the keyed Gumbel-max sample of
  // the sampler (docs/design.md: noise keyed by (seed, position, id)) among the row's
  // kDraftSampleTop best ids, so a draft close to the target proposes the target's own sample.
  // Row r equals verify(chain[0..r])[r] bitwise; committed state unchanged. One call instead
  // of `rows` chain verifies of growing length. `chain` (if given) receives a1..a(rows).
  // `prefix`: context tokens to commit first (at most max_draft_prefix()), taken in by the
  // chain's first forward with the root: a drafter's tokens the last chain did not cover
  // (after a fully kept chain, its last pick) cost no forward of their own; the state is
  // then prefill(prefix)'s, and the chain's rows follow it.
  std::vector<float> draft_chain(int root, int rows, double temperature = 0.0, uint64_t seed = 0,
                                 std::vector<int>* chain = nullptr,
                                 const std::vector<int>& prefix = {});
  // The longest draft_chain prefix: the GDN layers keep a prefix row's conv input in their
  // window only while the first forward has at most K-1 rows.
  int max_draft_prefix() const;
  // After a draft chain: adopt the longest prefix of `tokens` (the target's committed tokens)
  // that equals the chain's processed tokens (root, a1, ...) as committed, from what the
  // chain kept (their K/V rows, and per GDN layer their pending-tape entries), and return its
  // length m; the caller then prefills tokens[m:]. The result is the state
  // prefill(tokens[0..m)) gives. Any other call drops what the chain kept.
  int keep_draft(const std::vector<int>& tokens);
  static constexpr int kDraftSampleTop = 256;  // the tail past it has almost no mass
  // draft_chain ranked for a drafter: per row the chain's pick, then the k-1 other most likely
  // ids (ties: lower id), with their log-probabilities under the row's softmax. ids and logp
  // are [rows][k].
  // `keep` (exclusive with prefix): the target's committed tokens since the last chain,
  // taken first as keep_draft(keep) would, the rest prefilled or taken in as a prefix: a
  // drafter's advance and its next draft in one call.
  void draft_candidates(int root, int rows, int k, double temperature, uint64_t seed,
                        std::vector<int>* ids, std::vector<double>* logp,
                        const std::vector<int>& prefix = {}, const std::vector<int>& keep = {});
  void reset();
  // The target's final hidden states (after model.norm, [n][H]) of committed positions, for
  // a drafter that reads them (the MTP head): while keep_hidden is on, prefill and commit keep
  // the rows of the positions they commit (from the forward they already ran); take_hidden
  // hands over those since the last take and returns the position of the first. A change
  // that commits without a forward of its own (a snapshot's restore, keep_draft,
  // fill_synthetic) leaves a gap: the next rows start past it.
  void set_keep_hidden(bool on);
  bool keep_hidden() const { return keep_hidden_; }
  int take_hidden(std::vector<float>* rows);
  // Benchmarks of long contexts: append n synthetic positions (random K/V from `seed`; GDN
  // state left as it is) without paying for their prefill. Not a model computation.
  void fill_synthetic(int n, uint64_t seed);
  std::shared_ptr<Snapshot> snapshot() const;
  // Validates the whole snapshot (its model, its length against max_context, its pages and
  // GDN states), then applies it; on any failure the engine is unchanged.
  void restore(const Snapshot& s);
  // A hash of the dims, the weights as given, the weight format, the KV dtype and the page
  // size: engines built from the same checkpoint the same way have the same id.
  uint64_t model_id() const { return model_->model_id; }
  // The most nodes verify() takes: the forward's largest batch (a prefill chunk), so a tree
  // never raises the peak memory above a prompt's.
  static constexpr int kMaxVerifyNodes = 256;
  // The longest max_context: 2^24 positions keeps every page and position count an int.
  static constexpr int kMaxContext = 1 << 24;

  int position() const {
    Use use(*this);
    return be_->length();
  }
  int max_context() const { return max_context_; }
  const ModelDims& dims() const { return dims_; }
  size_t weight_bytes() const { return weights_.bytes(); }
  size_t kv_bytes() const { return be_->kv_bytes(); }
  const std::string backend() const { return be_->name(); }
  const ModelWeights& weights() const { return weights_; }
  size_t kv_bytes_used() const;
  int64_t syncs() const { return be_->syncs(); }
  size_t gdn_state_bytes() const;
  int threads() const { return threads_; }

  static constexpr int kPrefillChunk = 256;  // rows per forward while prefilling

 private:
  // Every public method that reads or changes state holds one: a call from a second thread
  // while one runs raises EngineBusy instead of blocking or racing. Nested calls on the
  // holding thread (draft_candidates -> draft_chain, position()) pass through.
  class Use {
   public:
    explicit Use(const Engine& e);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    Exclusive::Use use_;  // EngineBusy (exclusive.h): the engine holds one sequence's state
    std::unique_lock<std::recursive_mutex> device_;  // Backend::device_lock(), when it has one
  };
  Exclusive exclusive_;

  void check_tokens(const std::vector<int>& tokens) const;
  // verify()'s checks of a tree and its layout at the current position
  BatchLayout verify_layout(const std::vector<int>& tokens, const std::vector<int>& parents) const;
  // Appends the logits prefill(tokens, all_rows) returns to *out.
  // a draft chain's rows ranked on the backend (rank_row_on_backend): [rows][k] ids and logp
  struct Ranked {
    int k;
    std::vector<int> ids;
    std::vector<double> logp;
  };
  // draft_chain's loop: each row's logits appended to *out, or (greedy) ranked into *ranked
  void chain_rows(int root, int rows, double temperature, uint64_t seed, std::vector<int>* chain,
                  const std::vector<int>& prefix, std::vector<float>* out, Ranked* ranked);
  Act prefill_chunks(const std::vector<int>& tokens, bool all_rows, int P, std::vector<float>* out,
                      std::vector<float>* hidden = nullptr);
  void drop_hidden();  // the committed state moved without hidden rows: start past the gap
  // Threads for a forward of `rows` tokens: one while its whole work is below kForwardRegions
  // regions of min_parallel_work(). A forward is ~10 regions a layer and a small one is all
  // hand-offs: the bundled draft (1.58M multiply-adds a token) drafts chains faster on one
  // thread, while the bundled target's one-token verify (11.3M) is faster on two.
  static constexpr long long kForwardRegions = 128;
  int forward_threads(int rows) const {
    return threads_for((long long)rows * weights_.macs_per_token() / kForwardRegions, threads_);
  }
  void begin_change();  // any change of state: drops the verify tape and the kept draft
  // Waits for commit's background fold: first thing in every method that touches gdn_.
  void join_fold() const;
  mutable bool fold_running_ = false;

  std::shared_ptr<const SharedModel> model_;
  const ModelDims& dims_;        // model_'s
  const ModelWeights& weights_;  // model_'s
  int max_context_, threads_;
  Forward fwd_;
  std::unique_ptr<Backend> be_;     // the committed state and the ops of the forward
  std::vector<int> tape_parents_;   // empty: no verify to commit
  std::vector<int> draft_tokens_;   // the last draft chain's processed tokens; row r's GDN
  int draft_prefix_ = 0;            // token is the backend's kept slot draft_prefix_ + r
  bool keep_hidden_ = false;
  std::vector<float> hidden_;       // final hidden rows of committed positions [hidden_from_, P)
  std::vector<float> tape_hidden_;  // the last verify's rows [N][H]
  int hidden_from_ = 0;
};

}  // namespace sapwood

#include "engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"
#include "kernels/kernels.h"
#include "thread_pool.h"
#include "tree.h"

namespace sapwood {

Engine::Engine(const ModelDims& d, const TensorMap& t, WFormat wfmt, KVDtype kv, int max_context,
               int threads, int page_size, const std::string& backend)
    : dims_(d), max_context_(max_context), threads_(threads > 0 ? threads : default_threads()),
      fwd_(dims_, weights_) {
  SW_CHECK(d.vocab > 0 && d.hidden > 0 && d.inter > 0 && d.n_layers() > 0, "bad model dims");
  SW_CHECK(max_context > 0, "max_context must be positive, got ", max_context);
  SW_CHECK(d.n_attn() == 0 || (d.n_heads % d.n_kv_heads == 0 && d.head_dim % 32 == 0),
           "attention needs heads divisible by KV heads and head_dim a multiple of 32");
  SW_CHECK(d.rotary_dim % 2 == 0 && d.rotary_dim <= d.head_dim, "bad rotary_dim ", d.rotary_dim);
  weights_ = load_weights(d, t, wfmt);
  be_ = make_backend(backend, dims_, weights_, kv, max_context, page_size, threads_);
}

Engine::~Engine() {
  try {
    join_fold();
  } catch (...) {  // a failed fold leaves nothing to clean up
  }
}

void Engine::join_fold() const {
  if (!fold_running_) return;
  fold_running_ = false;
  wait_background();
}

void Engine::check_tokens(const std::vector<int>& tokens) const {
  SW_CHECK(!tokens.empty(), "no tokens given");
  for (size_t i = 0; i < tokens.size(); ++i)
    SW_CHECK(tokens[i] >= 0 && tokens[i] < dims_.vocab, "token id ", tokens[i], " at index ", i,
             " is outside the vocabulary [0, ", dims_.vocab, ")");
}

std::vector<float> Engine::prefill(const std::vector<int>& tokens, bool all_rows) {
  join_fold();
  check_tokens(tokens);
  const int P = position(), T = int(tokens.size());
  SW_CHECK(P + T <= max_context_, "context full: ", P, " committed + ", T, " new tokens > max_context ",
           max_context_);
  begin_change();
  be_->reserve(P + T);
  // A failure part-way (non-finite activations) must not leave some layers advanced.
  be_->save_gdn();
  try {
    std::vector<float> logits;
    prefill_chunks(tokens, all_rows, P, &logits);
    return logits;
  } catch (...) {
    be_->restore_gdn();
    be_->truncate(P);
    throw;
  }
}

void Engine::prefill_chunks(const std::vector<int>& tokens, bool all_rows, int P,
                            std::vector<float>* out) {
  const int T = int(tokens.size());
  for (int c0 = 0; c0 < T; c0 += kPrefillChunk) {
    const int n = std::min(kPrefillChunk, T - c0);
    BatchLayout lay;
    lay.n = n;
    lay.prefill = true;
    lay.hist_len = P + c0 + n;
    for (int i = 0; i < n; ++i) {
      lay.pos.push_back(P + c0 + i);
      lay.row_len.push_back(P + c0 + i + 1);
    }
    const bool last = c0 + n == T;
    const int from = all_rows ? 0 : (last ? n - 1 : n);
    be_->set_threads(forward_threads(n));
    fwd_.run(*be_, tokens.data() + c0, lay, from, out);
    be_->set_length(P + c0 + n);
  }
}

std::vector<float> Engine::verify(const std::vector<int>& tokens, const std::vector<int>& parents) {
  join_fold();
  SW_CHECK(tokens.size() == parents.size(), "tokens (", tokens.size(), ") and parents (",
           parents.size(), ") differ in length");
  check_tokens(tokens);
  const int n = int(tokens.size());
  check_parents(parents.data(), n);
  BatchLayout lay;
  lay.n = n;
  lay.parents = parents;
  lay.hist_len = position();
  lay.anc = ancestor_table(parents.data(), n, &lay.anc_stride);
  const std::vector<int> depth = tree_depths(parents.data(), n);
  const int deepest = *std::max_element(depth.begin(), depth.end());
  SW_CHECK(position() + deepest + 1 <= max_context_, "context full: position ", position(),
           " + tree depth ", deepest + 1, " > max_context ", max_context_);
  for (int i = 0; i < n; ++i) {
    lay.pos.push_back(position() + depth[i]);
    lay.row_len.push_back(position() + depth[i] + 1);
  }
  begin_change();
  be_->set_threads(forward_threads(n));
  std::vector<float> logits;
  fwd_.run(*be_, tokens.data(), lay, 0, &logits);
  tape_parents_ = parents;
  return logits;
}

void Engine::commit(const std::vector<int>& path, bool fold_in_background) {
  join_fold();
  SW_CHECK(!tape_parents_.empty(), "commit without a preceding verify");
  check_path(tape_parents_.data(), int(tape_parents_.size()), path);
  const int P = position(), m = int(path.size());
  be_->reserve(P + m);  // the only step that can fail: do it before changing anything
  be_->set_threads(threads_);
  be_->commit(P, path);
  begin_change();
  // One thread folds what the next verify would fold on all of them: worth it only while the
  // caller works elsewhere (a draft model's single-threaded rows), which is the caller's call.
  if (fold_in_background && threads_ > 1 && dims_.n_attn() < dims_.n_layers())
    fold_running_ = start_background([this] { be_->fold_pending(1); });
}

namespace {

// SplitMix64's finaliser, as sampling.mix64.
uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The draft's pick from one row of logits: argmax, or the keyed Gumbel-max sample among the
// `top` best ids (as sampling.sample without filters; the tail beyond `top` is left out, which
// only matters for proposals, never for what is emitted).
int draft_pick(const float* row, int V, double temperature, uint64_t seed, uint64_t position,
               int top) {
  if (temperature <= 0.0) return kernels().argmax(row, size_t(V));  // first max
  std::vector<int> ids(V);
  for (int i = 0; i < V; ++i) ids[i] = i;
  top = std::min(top, V);
  std::nth_element(ids.begin(), ids.begin() + (top - 1), ids.end(), [&](int a, int b) {
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  });
  const uint64_t key = mix64(mix64(seed) ^ position);
  const double m = *std::max_element(row, row + V);
  int pick = ids[0];
  double best = -INFINITY;
  for (int i = 0; i < top; ++i) {
    const int id = ids[i];
    const double u = (double(mix64(key ^ uint64_t(id)) >> 11) + 0.5) * 0x1p-53;
    const double score = (double(row[id]) - m) / temperature - std::log(-std::log(u));
    if (score > best || (score == best && id < pick)) best = score, pick = id;
  }
  return pick;
}

}  // namespace

int Engine::max_draft_prefix() const {
  // A backend that keeps no rows re-prefills the prefix after the chain: none is taken in.
  if (!be_->keeps_rows()) return 0;
  const bool gdn = dims_.n_attn() < dims_.n_layers();
  return !gdn || dims_.gdn().conv_k <= 1 ? 64 : dims_.gdn().conv_k - 2;
}

std::vector<float> Engine::draft_chain(int root, int rows, double temperature, uint64_t seed,
                                       std::vector<int>* chain, const std::vector<int>& prefix) {
  join_fold();
  if (!prefix.empty()) check_tokens(prefix);
  check_tokens({root});
  SW_CHECK(std::isfinite(temperature) && temperature >= 0.0, "draft_chain: temperature must be "
           "finite and >= 0, got ", temperature);
  const int np = int(prefix.size());
  SW_CHECK(np <= max_draft_prefix(), "draft_chain: a prefix of ", np, " tokens (at most ",
           max_draft_prefix(), ")");
  const int P = position(), V = dims_.vocab, R = P + np;  // R: the root's position
  SW_CHECK(rows >= 1 && R + rows <= max_context_, "draft_chain: ", rows, " rows at position ", R,
           " (max_context ", max_context_, ")");
  begin_change();
  be_->reserve(R + rows);
  // Pending tokens (keep_draft's rows) are folded for good first: the chain's first forward
  // would fold them and the roll-back would bring them back, to be folded again by every
  // chain until a prefill.
  be_->fold_pending(forward_threads(1));
  // Commit one token per row, then roll back: the GDN layers are restored from a copy, and
  // the length goes back while the pages stay reserved, so positions R.. keep the chain's
  // K/V. Every row's GDN token is kept too (slots np + r; the prefix's in slots 0..np):
  // keep_draft() adopts the rows the target then commits as pending tokens instead of
  // prefilling them again. The prefix stays committed: its GDN tokens follow the restored
  // state as pending ones, as keep_draft's rows do.
  be_->save_gdn();
  const bool keep = be_->keeps_rows();
  std::vector<float> out;  // rows appended as they come (not zeroed first: 128 KiB a chain)
  out.reserve(size_t(rows) * V);
  try {
    int tok = root;
    for (int r = 0; r < rows; ++r) {
      std::vector<int> toks = r == 0 ? prefix : std::vector<int>{};
      toks.push_back(tok);
      prefill_chunks(toks, false, r == 0 ? P : R + r, &out);
      for (int i = 0; keep && r == 0 && i < np; ++i) be_->keep_row(i, i);
      draft_tokens_.push_back(tok);
      if (keep) be_->keep_row(np + r, int(toks.size()) - 1);
      tok = draft_pick(out.data() + size_t(r) * V, V, temperature, seed, uint64_t(R + r + 1),
                       kDraftSampleTop);
      if (chain) chain->push_back(tok);
    }
  } catch (...) {
    begin_change();
    be_->restore_gdn();
    be_->truncate(P);
    throw;
  }
  be_->restore_gdn();
  std::vector<int> slots(np);
  for (int i = 0; i < np; ++i) slots[i] = i;
  be_->append_kept(slots, threads_);
  draft_prefix_ = np;
  be_->set_length(R);
  return out;
}

int Engine::keep_draft(const std::vector<int>& tokens) {
  join_fold();
  check_tokens(tokens);
  int m = 0;
  while (m < int(tokens.size()) && m < int(draft_tokens_.size()) && tokens[m] == draft_tokens_[m])
    ++m;
  if (!be_->keeps_rows()) m = 0;  // nothing kept: the caller prefills them all
  // the chain restored the state before it: its first m rows follow as pending tokens
  std::vector<int> slots(m);
  for (int r = 0; r < m; ++r) slots[r] = draft_prefix_ + r;
  be_->append_kept(slots, threads_);
  begin_change();  // drops the kept rows: the state moves on
  be_->set_length(position() + m);
  return m;
}

void Engine::begin_change() {
  tape_parents_.clear();
  draft_tokens_.clear();  // the backend's kept slots keep their buffers for the next chain
}

void Engine::draft_candidates(int root, int rows, int k, double temperature, uint64_t seed,
                              std::vector<int>* ids, std::vector<double>* logp,
                              const std::vector<int>& prefix) {
  SW_CHECK(k >= 1, "draft_candidates: k must be >= 1, got ", k);
  const int V = dims_.vocab;
  k = std::min(k, V);
  std::vector<int> chain;  // draft_chain checks root and rows
  const std::vector<float> z = draft_chain(root, rows, temperature, seed, &chain, prefix);
  ids->assign(size_t(rows) * k, 0);
  logp->assign(ids->size(), 0.0);
  for (int r = 0; r < rows; ++r) {
    const float* row = z.data() + size_t(r) * V;
    const double lse = kernels().logsumexp(row, size_t(V));
    int* out = ids->data() + size_t(r) * k;
    out[0] = chain[r];
    kernels().top_ids(row, V, k - 1, chain[r], out + 1);  // the k-1 best other ids
    for (int j = 0; j < k; ++j) (*logp)[size_t(r) * k + j] = double(row[out[j]]) - lse;
  }
}

void Engine::reset() {
  join_fold();
  be_->reset();
  begin_change();
}

void Engine::fill_synthetic(int n, uint64_t seed) {
  join_fold();
  SW_CHECK(n >= 0 && position() + n <= max_context_, "fill_synthetic: ", n, " positions past ",
           position(), " exceed max_context ", max_context_);
  begin_change();
  const int P = position();
  be_->reserve(P + n);
  be_->fill_synthetic(P, n, seed);
  be_->set_length(P + n);
}

std::shared_ptr<Snapshot> Engine::snapshot() const {
  join_fold();
  auto s = std::make_shared<Snapshot>();
  s->length = position();
  s->backend = be_->name();
  be_->snapshot(s.get());
  return s;
}

void Engine::restore(const Snapshot& s) {
  join_fold();
  SW_CHECK(s.backend == be_->name(), "snapshot is from the ", s.backend, " backend, this engine runs ",
           be_->name());
  be_->restore(s);  // validates, then applies
  begin_change();
}

size_t Engine::kv_bytes_used() const { return be_->kv_bytes_used(); }

size_t Engine::gdn_state_bytes() const {
  join_fold();
  return be_->gdn_state_bytes();
}

}  // namespace sapwood

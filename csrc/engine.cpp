#include "engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"
#include "kernels/kernels.h"
#include "sampler.h"
#include "thread_pool.h"
#include "tree.h"

namespace sapwood {

namespace {

// Every constructor argument, before anything is built from it (a zero KV head count divided
// by it; a huge max_context overflowed the page count).
const ModelDims& checked(const ModelDims& d, int max_context, int threads, int page_size) {
  constexpr int kBig = 1 << 24;  // larger than any real dimension, small enough for int sizes
  auto dim = [&](int v, const char* name, int lo) {
    SW_CHECK(v >= lo && v <= kBig, "dims: ", name, " must be in [", lo, ", ", kBig, "], got ", v);
  };
  dim(d.vocab, "vocab_size", 1);
  dim(d.hidden, "hidden_size", 1);
  dim(d.inter, "intermediate_size", 1);
  SW_CHECK(d.n_layers() > 0 && d.n_layers() <= 4096, "dims: layer_is_attention must list 1 to 4096 "
           "layers, got ", d.n_layers());
  SW_CHECK(std::isfinite(d.eps) && d.eps > 0, "dims: rms_norm_eps must be finite and > 0, got ", d.eps);
  if (d.n_attn() > 0) {
    dim(d.n_heads, "num_heads", 1);
    dim(d.n_kv_heads, "num_kv_heads", 1);
    SW_CHECK(d.n_heads % d.n_kv_heads == 0, "dims: num_heads=", d.n_heads,
             " is not a multiple of num_kv_heads=", d.n_kv_heads);
    SW_CHECK(d.head_dim > 0 && d.head_dim % 32 == 0 && d.head_dim <= 1024,
             "dims: head_dim must be a multiple of 32 up to 1024, got ", d.head_dim);
    SW_CHECK(d.rotary_dim >= 0 && d.rotary_dim % 2 == 0 && d.rotary_dim <= d.head_dim,
             "dims: rotary_dim must be even and in [0, head_dim=", d.head_dim, "], got ", d.rotary_dim);
    SW_CHECK(std::isfinite(d.rope_theta) && d.rope_theta > 0,
             "dims: rope_theta must be finite and > 0, got ", d.rope_theta);
  }
  if (d.n_attn() < d.n_layers()) {
    dim(d.hk, "hk", 1), dim(d.hv, "hv", 1), dim(d.dk, "dk", 1), dim(d.dv, "dv", 1);
    SW_CHECK(d.hv % d.hk == 0, "dims: hv=", d.hv, " is not a multiple of hk=", d.hk);
    SW_CHECK(d.conv_k >= 1 && d.conv_k <= 64, "dims: conv_kernel must be in [1, 64], got ", d.conv_k);
  }
  SW_CHECK(max_context > 0 && max_context <= Engine::kMaxContext, "max_context must be in [1, ",
           Engine::kMaxContext, "], got ", max_context);
  SW_CHECK(threads >= 0 && threads <= 1024, "threads must be in [0, 1024] (0: the default), got ",
           threads);
  SW_CHECK(page_size > 0 && page_size % 32 == 0 && page_size <= 4096,
           "page_size must be a multiple of 32 up to 4096, got ", page_size);
  return d;
}

// The dims and formats, then every weight's values as the loader streamed them.
uint64_t fingerprint(const ModelDims& d, const WeightLoader& t, WFormat wfmt, KVDtype kv,
                     int page_size) {
  WeightHasher h;
  for (int v : {d.vocab, d.hidden, d.inter, d.n_heads, d.n_kv_heads, d.head_dim, d.rotary_dim,
                d.hk, d.dk, d.hv, d.dv, d.conv_k, int(d.tied), int(d.tiled), int(wfmt), int(kv),
                page_size})
    h.value(v);
  h.value(d.rope_theta), h.value(d.eps);
  for (bool a : d.is_attn) h.value(a);
  h.value(t.fingerprint());
  return h.h;
}

}  // namespace

Engine::Use::Use(const Engine& e)
    : use_(e.exclusive_, "engine is in use by another thread: an Engine runs one call at a time "
                         "(give each thread its own Engine, or serialise the calls)") {
  if (!use_.outer()) return;  // nested on this thread: the device lock is held already
  if (std::recursive_mutex* m = e.be_->device_lock()) device_ = std::unique_lock<std::recursive_mutex>(*m);
}

Engine::Use::~Use() = default;

namespace {

std::shared_ptr<const SharedModel> build_model(const ModelDims& d, TensorSource& src, WFormat wfmt,
                                               KVDtype kv, int max_context, int threads,
                                               int page_size) {
  auto m = std::make_shared<SharedModel>();
  m->dims = checked(d, max_context, threads, page_size);
  WeightLoader loader(src, threads > 0 ? threads : default_threads());
  m->weights = load_weights(d, loader, wfmt);
  m->model_id = fingerprint(d, loader, wfmt, kv, page_size);
  return m;
}

}  // namespace

Engine::Engine(const ModelDims& d, TensorSource& t, WFormat wfmt, KVDtype kv, int max_context,
               int threads, int page_size, const std::string& backend)
    : model_(build_model(d, t, wfmt, kv, max_context, threads, page_size)), dims_(model_->dims),
      weights_(model_->weights), max_context_(max_context),
      threads_(threads > 0 ? threads : default_threads()), fwd_(dims_, weights_) {
  be_ = make_backend(backend, dims_, weights_, kv, max_context, page_size, threads_);
}

Engine::Engine(const Engine& base, int max_context, int threads)
    : model_(base.model_), dims_(model_->dims), weights_(model_->weights),
      max_context_(max_context > 0 ? max_context : base.max_context_),
      threads_(threads > 0 ? threads : base.threads_), fwd_(dims_, weights_) {
  SW_CHECK(max_context >= 0 && max_context <= kMaxContext, "max_context must be in [1, ",
           kMaxContext, "] (0: the base engine's), got ", max_context);
  SW_CHECK(threads >= 0 && threads <= 1024, "threads must be in [0, 1024] (0: the base engine's), "
           "got ", threads);
  be_ = base.be_->new_sequence(max_context_, threads_);
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
  Use use(*this);
  join_fold();
  check_tokens(tokens);
  const int P = position(), T = int(tokens.size());
  SW_CHECK(P + T <= max_context_, "context full: ", P, " committed + ", T, " new tokens > max_context ",
           max_context_);
  begin_change();
  be_->reserve(P + T);
  // A failure part-way (non-finite activations) must not leave some layers advanced.
  be_->save_gdn();
  const size_t kept = hidden_.size();
  try {
    std::vector<float> logits;
    prefill_chunks(tokens, all_rows, P, &logits, keep_hidden_ ? &hidden_ : nullptr);
    return logits;
  } catch (...) {
    be_->restore_gdn();
    be_->truncate(P);
    hidden_.resize(kept);
    throw;
  }
}

Act Engine::prefill_chunks(const std::vector<int>& tokens, bool all_rows, int P,
                           std::vector<float>* out, std::vector<float>* hidden) {
  std::vector<float> rows, none;
  const int T = int(tokens.size());
  Act y{};
  for (int c0 = 0; c0 < T; c0 += kPrefillChunk) {
    const int n = std::min(kPrefillChunk, T - c0);
    const BatchLayout lay = prefill_layout(P + c0, n);
    const bool last = c0 + n == T;
    const int from = all_rows ? 0 : (last ? n - 1 : n);
    be_->set_threads(forward_threads(n));
    // a chunk before the last downloads its (no) logits all the same: a device backend's
    // download is the sync point after which the next forward's inputs may be written
    y = fwd_.run(*be_, tokens.data() + c0, lay, from, last || out ? out : &none,
                 hidden ? &rows : nullptr);
    if (hidden) hidden->insert(hidden->end(), rows.begin(), rows.end());
    be_->set_length(P + c0 + n);
  }
  return y;
}

BatchLayout Engine::verify_layout(const std::vector<int>& tokens, const std::vector<int>& parents) const {
  SW_CHECK(tokens.size() == parents.size(), "tokens (", tokens.size(), ") and parents (",
           parents.size(), ") differ in length");
  SW_CHECK(tokens.size() <= size_t(kMaxVerifyNodes), "verify: a tree of ", tokens.size(),
           " nodes; at most ", kMaxVerifyNodes, " are verified at once");
  check_tokens(tokens);
  BatchLayout lay = sapwood::tree_layout(position(), parents);
  const int deepest = *std::max_element(lay.pos.begin(), lay.pos.end()) - position();
  SW_CHECK(position() + deepest + 1 <= max_context_, "context full: position ", position(),
           " + tree depth ", deepest + 1, " > max_context ", max_context_);
  return lay;
}

std::vector<float> Engine::verify(const std::vector<int>& tokens, const std::vector<int>& parents) {
  Use use(*this);
  join_fold();
  const BatchLayout lay = verify_layout(tokens, parents);
  begin_change();
  be_->set_threads(forward_threads(lay.n));
  std::vector<float> logits;
  fwd_.run(*be_, tokens.data(), lay, 0, &logits, keep_hidden_ ? &tape_hidden_ : nullptr);
  tape_parents_ = parents;
  return logits;
}

Walk Engine::verify_walk(const std::vector<int>& tokens, const std::vector<int>& parents,
                         const SampleParams& p, bool commit_path, bool fold_in_background,
                         std::vector<float>* logits, const uint32_t* masks) {
  check_sample_params(p);  // before any change of state
  Use use(*this);
  join_fold();
  const uint64_t base = uint64_t(be_->length());
  std::vector<float> z = verify(tokens, parents);
  // a mask error (a row allowing nothing) comes before the commit: the state is unchanged
  Walk w = walk_tree(z.data(), dims_.vocab, tokens, parents, base, p, threads_, masks);
  if (commit_path) commit(w.path, fold_in_background);
  if (logits) *logits = std::move(z);
  return w;
}

std::vector<std::vector<float>> Engine::verify_many(const std::vector<Engine*>& engines,
                                                    const std::vector<std::vector<int>>& tokens,
                                                    const std::vector<std::vector<int>>& parents) {
  const size_t k = engines.size();
  SW_CHECK(k >= 1, "verify_many: no sequences given");
  SW_CHECK(tokens.size() == k && parents.size() == k, "verify_many: ", k, " engines, ",
           tokens.size(), " token lists and ", parents.size(), " parent lists");
  Engine& lead = *engines[0];
  for (size_t i = 0; i < k; ++i) {
    SW_CHECK(engines[i] != nullptr, "verify_many: sequence ", i, " has no engine");
    SW_CHECK(engines[i]->model_ == lead.model_, "verify_many: sequence ", i, "'s engine does not "
             "share sequence 0's weights (make the engines with new_sequence)");
    for (size_t j = 0; j < i; ++j)
      SW_CHECK(engines[j] != engines[i], "verify_many: sequences ", j, " and ", i,
               " are the same engine (one tree per sequence)");
  }
  // every engine claimed and checked before any state changes
  std::vector<std::unique_ptr<Use>> uses;
  std::vector<BatchLayout> lays(k);
  std::vector<int> all;
  for (size_t i = 0; i < k; ++i) {
    Engine& e = *engines[i];
    uses.push_back(std::make_unique<Use>(e));
    e.join_fold();
    try {
      lays[i] = e.verify_layout(tokens[i], parents[i]);
    } catch (const InputError& x) {
      throw InputError(cat("verify_many: sequence ", i, ": ", x.what()));
    }
    all.insert(all.end(), tokens[i].begin(), tokens[i].end());
  }
  SW_CHECK(all.size() <= size_t(kMaxVerifyNodes), "verify_many: ", all.size(), " nodes in all; at "
           "most ", kMaxVerifyNodes, " are verified in one forward");
  // the sequences' threads pooled: each caller waits for this one forward
  int pooled = 0;
  for (Engine* e : engines) pooled += e->threads_;
  const int threads = threads_for(
      (long long)all.size() * lead.weights_.macs_per_token() / kForwardRegions, pooled);
  std::vector<SeqRows> parts(k);
  bool hidden = false;
  for (size_t i = 0; i < k; ++i) {
    Engine& e = *engines[i];
    e.begin_change();
    e.be_->set_threads(threads);
    parts[i] = SeqRows{e.be_.get(), &lays[i]};
    hidden = hidden || e.keep_hidden_;
  }
  std::vector<float> logits, rows;
  lead.fwd_.run_forest(*lead.be_, parts, all.data(), &logits, hidden ? &rows : nullptr);
  std::vector<std::vector<float>> out(k);
  const size_t V = size_t(lead.dims_.vocab), H = size_t(lead.dims_.hidden);
  size_t r0 = 0;
  for (size_t i = 0; i < k; ++i) {
    Engine& e = *engines[i];
    const size_t n = size_t(lays[i].n);
    out[i].assign(logits.begin() + r0 * V, logits.begin() + (r0 + n) * V);
    if (e.keep_hidden_) e.tape_hidden_.assign(rows.begin() + r0 * H, rows.begin() + (r0 + n) * H);
    e.tape_parents_ = parents[i];
    r0 += n;
  }
  return out;
}

void Engine::commit(const std::vector<int>& path, bool fold_in_background) {
  Use use(*this);
  join_fold();
  SW_CHECK(!tape_parents_.empty(), "commit without a preceding verify");
  check_path(tape_parents_.data(), int(tape_parents_.size()), path);
  const int P = position(), m = int(path.size());
  be_->reserve(P + m);  // the only step that can fail: do it before changing anything
  be_->set_threads(threads_);
  be_->commit(P, path);
  if (keep_hidden_) {
    const size_t H = size_t(dims_.hidden);
    for (int i : path)
      hidden_.insert(hidden_.end(), tape_hidden_.begin() + i * H, tape_hidden_.begin() + (i + 1) * H);
  }
  begin_change();
  // One thread folds what the next verify would fold on all of them: worth it only while the
  // caller works elsewhere (a draft model's single-threaded rows), which is the caller's call.
  if (fold_in_background && threads_ > 1 && dims_.n_attn() < dims_.n_layers())
    fold_running_ = start_background([this] { be_->fold_pending(1); });
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

void rank_draft_rows(const float* z, int rows, int V, int k, const std::vector<int>& chain,
                     std::vector<int>* ids, std::vector<double>* logp) {
  ids->assign(size_t(rows) * k, 0);
  logp->assign(ids->size(), 0.0);
  for (int r = 0; r < rows; ++r) {
    const float* row = z + size_t(r) * V;
    const double lse = kernels().logsumexp(row, size_t(V));
    int* out = ids->data() + size_t(r) * k;
    out[0] = chain[r];
    kernels().top_ids(row, V, k - 1, chain[r], out + 1);  // the k-1 best other ids
    for (int j = 0; j < k; ++j) (*logp)[size_t(r) * k + j] = double(row[out[j]]) - lse;
  }
}

int Engine::max_draft_prefix() const {
  // A backend that keeps no rows re-prefills the prefix after the chain: none is taken in.
  if (!be_->keeps_rows()) return 0;
  const bool gdn = dims_.n_attn() < dims_.n_layers();
  return !gdn || dims_.gdn().conv_k <= 1 ? 64 : dims_.gdn().conv_k - 2;
}

std::vector<float> Engine::draft_chain(int root, int rows, double temperature, uint64_t seed,
                                       std::vector<int>* chain, const std::vector<int>& prefix) {
  std::vector<float> out;  // rows appended as they come (not zeroed first: 128 KiB a chain)
  out.reserve(size_t(rows) * dims_.vocab);
  chain_rows(root, rows, temperature, seed, chain, prefix, &out, nullptr);
  return out;
}

int rank_row_on_backend(Backend& be, Act y, int V, int k, std::vector<int>* ids,
                        std::vector<double>* logp) {
  Act pick = be.scratch(Forward::kDraftPick, size_t(2 * k + 1));
  be.top_k_rows(y, 1, V, k, pick, pick + size_t(k));
  be.logsumexp_rows(y, 1, V, pick + size_t(2 * k));
  std::vector<float> got(size_t(2 * k + 1));
  be.download(pick, got.size(), got.data());
  const double lse = got[size_t(2 * k)];
  int first = 0;
  for (int j = 0; j < k; ++j) {
    int id;
    std::memcpy(&id, &got[size_t(j)], sizeof id);  // int32 bits (backend.h)
    const bool ok = id >= 0;  // fewer than k ids that are not NaN
    if (j == 0) first = ok ? id : 0;  // argmax's answer for a row of NaNs
    ids->push_back(ok ? id : 0);
    logp->push_back(ok ? double(got[size_t(k + j)]) - lse : -INFINITY);
  }
  return first;
}

void Engine::chain_rows(int root, int rows, double temperature, uint64_t seed,
                        std::vector<int>* chain, const std::vector<int>& prefix,
                        std::vector<float>* out, Ranked* ranked) {
  Use use(*this);
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
  try {
    int tok = root;
    for (int r = 0; r < rows; ++r) {
      std::vector<int> toks = r == 0 ? prefix : std::vector<int>{};
      toks.push_back(tok);
      const Act y = prefill_chunks(toks, false, r == 0 ? P : R + r, out);
      for (int i = 0; keep && r == 0 && i < np; ++i) be_->keep_row(i, i);
      draft_tokens_.push_back(tok);
      if (keep) be_->keep_row(np + r, int(toks.size()) - 1);
      tok = ranked ? rank_row_on_backend(*be_, y, V, ranked->k, &ranked->ids, &ranked->logp)
                   : draft_pick(out->data() + size_t(r) * V, V, temperature, seed,
                                uint64_t(R + r + 1), kDraftSampleTop);
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
  if (np) drop_hidden();
}

int Engine::keep_draft(const std::vector<int>& tokens) {
  Use use(*this);
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
  if (m) drop_hidden();
  return m;
}

void Engine::begin_change() {
  tape_parents_.clear();
  draft_tokens_.clear();  // the backend's kept slots keep their buffers for the next chain
}

void Engine::draft_candidates(int root, int rows, int k, double temperature, uint64_t seed,
                              std::vector<int>* ids, std::vector<double>* logp,
                              const std::vector<int>& prefix, const std::vector<int>& keep) {
  Use use(*this);
  SW_CHECK(k >= 1, "draft_candidates: k must be >= 1, got ", k);
  SW_CHECK(keep.empty() || prefix.empty(), "draft_candidates: keep and prefix are exclusive");
  const int V = dims_.vocab;
  k = std::min(k, V);
  std::vector<int> pre = prefix;
  if (!keep.empty()) {  // keep_draft(keep), then what the last chain did not cover
    const int m = keep_draft(keep);
    pre.assign(keep.begin() + m, keep.end());
    if (int(pre.size()) > max_draft_prefix()) {
      prefill(pre, false);
      pre.clear();
    }
  }
  std::vector<int> chain;  // chain_rows checks root and rows
  if (temperature <= 0.0 && k <= Backend::kMaxTopK) {
    // greedy: each row's pick and candidates come from the backend, the logits stay there
    Ranked ranked{k, {}, {}};
    chain_rows(root, rows, temperature, seed, &chain, pre, nullptr, &ranked);
    ids->swap(ranked.ids);
    logp->swap(ranked.logp);
    return;
  }
  const std::vector<float> z = draft_chain(root, rows, temperature, seed, &chain, pre);
  rank_draft_rows(z.data(), rows, V, k, chain, ids, logp);
}

void Engine::reset() {
  Use use(*this);
  join_fold();
  be_->reset();
  begin_change();
  drop_hidden();
}

void Engine::drop_hidden() {
  hidden_.clear();
  hidden_from_ = position();
}

void Engine::set_keep_hidden(bool on) {
  Use use(*this);
  keep_hidden_ = on;
  drop_hidden();
}

int Engine::take_hidden(std::vector<float>* rows) {
  Use use(*this);
  join_fold();
  const int from = hidden_from_;
  rows->swap(hidden_);
  drop_hidden();
  return from;
}

void Engine::fill_synthetic(int n, uint64_t seed) {
  Use use(*this);
  join_fold();
  SW_CHECK(n >= 0 && position() + n <= max_context_, "fill_synthetic: ", n, " positions past ",
           position(), " exceed max_context ", max_context_);
  begin_change();
  const int P = position();
  be_->reserve(P + n);
  // random K/V in [-1, 1), position by position and layer by layer (k, then v), handed to the
  // backend a chunk of positions at a time so a long context needs no buffer of its size
  constexpr int kChunk = 256;
  const size_t row = size_t(dims_.n_kv_heads) * dims_.head_dim;
  const int layers = dims_.n_attn();
  std::vector<std::vector<float>> k(layers, std::vector<float>(kChunk * row)), v = k;
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&] {  // xorshift
    z ^= z << 13, z ^= z >> 7, z ^= z << 17;
    return float(int64_t(z >> 11) - (int64_t(1) << 52)) / float(int64_t(1) << 52);
  };
  for (int c0 = 0; c0 < n; c0 += kChunk) {
    const int m = std::min(kChunk, n - c0);
    for (int p = 0; p < m; ++p)
      for (int a = 0; a < layers; ++a) {
        for (size_t i = 0; i < row; ++i) k[a][p * row + i] = next();
        for (size_t i = 0; i < row; ++i) v[a][p * row + i] = next();
      }
    for (int a = 0; a < layers; ++a) be_->write_kv(a, P + c0, m, k[a].data(), v[a].data());
  }
  be_->set_length(P + n);
  drop_hidden();
}

std::shared_ptr<Snapshot> Engine::snapshot() const {
  Use use(*this);
  join_fold();
  auto s = std::make_shared<Snapshot>();
  s->length = position();
  s->backend = be_->name();
  s->model_id = model_->model_id;
  be_->snapshot(s.get());
  return s;
}

void Engine::restore(const Snapshot& s) {
  Use use(*this);
  join_fold();
  SW_CHECK(s.backend == be_->name(), "snapshot is from the ", s.backend, " backend, this engine runs ",
           be_->name());
  SW_CHECK(s.model_id == model_->model_id, "snapshot is from another model (model id ", std::hex,
           s.model_id, ", this engine's ", model_->model_id, ")");
  SW_CHECK(s.length >= 0 && s.length <= max_context_, "snapshot of ", s.length,
           " positions does not fit max_context ", max_context_);
  be_->restore(s);  // validates, then applies
  begin_change();
  drop_hidden();
}

size_t Engine::kv_bytes_used() const {
  Use use(*this);
  return be_->kv_bytes_used();
}

size_t Engine::gdn_state_bytes() const {
  Use use(*this);
  join_fold();
  return be_->gdn_state_bytes();
}

}  // namespace sapwood

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
               int threads, int page_size)
    : dims_(d), max_context_(max_context), threads_(threads > 0 ? threads : default_threads()),
      fwd_(dims_, weights_, threads_) {
  SW_CHECK(d.vocab > 0 && d.hidden > 0 && d.inter > 0 && d.n_layers() > 0, "bad model dims");
  SW_CHECK(max_context > 0, "max_context must be positive, got ", max_context);
  SW_CHECK(d.n_attn() == 0 || (d.n_heads % d.n_kv_heads == 0 && d.head_dim % 32 == 0),
           "attention needs heads divisible by KV heads and head_dim a multiple of 32");
  SW_CHECK(d.rotary_dim % 2 == 0 && d.rotary_dim <= d.head_dim, "bad rotary_dim ", d.rotary_dim);
  weights_ = load_weights(d, t, wfmt);
  const int pages = (max_context + page_size - 1) / page_size;
  pool_ = std::make_shared<KVPagePool>(pages, page_size, std::max(1, d.n_attn()),
                                       std::max(1, d.n_kv_heads), std::max(32, d.head_dim), kv);
  seq_ = std::make_unique<KVSequence>(pool_);
  // A committed path of up to 32 draft rows and its root stays pending (the decoder drafts at
  // most 32 rows): the next verify folds it inside its own GDN region. Folding the excess in
  // commit ran one more parallel region a layer whenever all 8 rows were kept: bundled
  // target, commit of a 9-node chain 118-122 -> 68-73 us (3 alternated processes); with the
  // window slid in place (GDNLayer::slide_window) 56-57 us, and greedy chain decode on four
  // prompts that keep most rows (docstring, table, cjk, test) +5-10%.
  constexpr int kMaxPending = 33;
  for (int l = 0; l < d.n_layers(); ++l)
    if (!d.is_attn[l]) gdn_.emplace_back(d.gdn(), weights_.layers[l].conv_w.data(), kMaxPending);
  tape_.resize(d.n_attn());
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
  seq_->reserve(P + T);
  // A failure part-way (non-finite activations) must not leave some layers advanced.
  save_gdn();
  try {
    std::vector<float> logits;
    prefill_chunks(tokens, all_rows, P, &logits);
    return logits;
  } catch (...) {
    restore_gdn();
    seq_->truncate(P);
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
    fwd_.set_threads(forward_threads(n));
    fwd_.run(tokens.data() + c0, lay, *seq_, gdn_, tape_, from, out);
    seq_->set_length(P + c0 + n);
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
  fwd_.set_threads(forward_threads(n));
  std::vector<float> logits;
  fwd_.run(tokens.data(), lay, *seq_, gdn_, tape_, 0, &logits);
  tape_parents_ = parents;
  return logits;
}

void Engine::commit(const std::vector<int>& path, bool fold_in_background) {
  join_fold();
  SW_CHECK(!tape_parents_.empty(), "commit without a preceding verify");
  check_path(tape_parents_.data(), int(tape_parents_.size()), path);
  const int P = position(), m = int(path.size());
  seq_->reserve(P + m);  // the only step that can fail: do it before changing anything
  const int Hkv = dims_.n_kv_heads, D = dims_.head_dim;
  for (size_t a = 0; a < tape_.size(); ++a)
    for (int j = 0; j < m; ++j)
      seq_->write(P + j, int(a), tape_[a].k.data() + size_t(path[j]) * Hkv * D,
                  tape_[a].v.data() + size_t(path[j]) * Hkv * D);
  seq_->set_length(P + m);
  for (GDNLayer& g : gdn_) g.commit(path, threads_);
  begin_change();
  // One thread folds what the next verify would fold on all of them: worth it only while the
  // caller works elsewhere (a draft model's single-threaded rows), which is the caller's call.
  if (fold_in_background && threads_ > 1 && !gdn_.empty())
    fold_running_ = start_background([this] {
      for (GDNLayer& g : gdn_) g.fold_pending(1);
    });
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
  return gdn_.empty() || dims_.gdn().conv_k <= 1 ? 64 : dims_.gdn().conv_k - 2;
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
  seq_->reserve(R + rows);
  // Pending tokens (keep_draft's rows) are folded for good first: the chain's first forward
  // would fold them and the roll-back would bring them back, to be folded again by every
  // chain until a prefill (up to kMaxPending of them: the bundled draft took 250-370 us more
  // a chain).
  for (GDNLayer& g : gdn_) g.fold_pending(forward_threads(1));
  // Commit one token per row, then roll back: the GDN layers are restored from a copy, and
  // the length goes back while the pages stay reserved, so positions R.. keep the chain's
  // K/V. Every row's GDN token is kept too: keep_draft() adopts the rows the target then
  // commits as pending tokens instead of prefilling them again. The prefix stays committed:
  // its GDN tokens follow the restored state as pending ones, as keep_draft's rows do.
  save_gdn();
  std::vector<std::vector<GDNLayer::Token>> prefix_gdn(np > 0 ? gdn_.size() : 0);  // [layer][row]
  std::vector<float> out;  // rows appended as they come (not zeroed first: 128 KiB a chain)
  out.reserve(size_t(rows) * V);
  // The per-row GDN tokens reuse the last chain's buffers (begin_change() only empties
  // draft_tokens_): a chain allocated 5 vectors a row and GDN layer.
  if (draft_gdn_.size() < size_t(rows)) draft_gdn_.resize(rows);
  try {
    int tok = root;
    for (int r = 0; r < rows; ++r) {
      std::vector<int> toks = r == 0 ? prefix : std::vector<int>{};
      toks.push_back(tok);
      prefill_chunks(toks, false, r == 0 ? P : R + r, &out);
      for (size_t l = 0; r == 0 && l < prefix_gdn.size(); ++l) {
        prefix_gdn[l].resize(np);
        for (int i = 0; i < np; ++i) gdn_[l].token(i, &prefix_gdn[l][i]);
      }
      draft_tokens_.push_back(tok);
      draft_gdn_[r].resize(gdn_.size());
      for (size_t l = 0; l < gdn_.size(); ++l)
        gdn_[l].token(int(toks.size()) - 1, &draft_gdn_[r][l]);
      tok = draft_pick(out.data() + size_t(r) * V, V, temperature, seed, uint64_t(R + r + 1),
                       kDraftSampleTop);
      if (chain) chain->push_back(tok);
    }
  } catch (...) {
    begin_change();
    restore_gdn();
    seq_->truncate(P);
    throw;
  }
  restore_gdn();
  for (size_t l = 0; l < prefix_gdn.size(); ++l) {
    std::vector<const GDNLayer::Token*> rows_l(np);
    for (int i = 0; i < np; ++i) rows_l[i] = &prefix_gdn[l][i];
    gdn_[l].append_pending(rows_l.data(), np, threads_);
  }
  seq_->set_length(R);
  return out;
}

int Engine::keep_draft(const std::vector<int>& tokens) {
  join_fold();
  check_tokens(tokens);
  int m = 0;
  while (m < int(tokens.size()) && m < int(draft_tokens_.size()) && tokens[m] == draft_tokens_[m])
    ++m;
  // the chain restored the state before it: its first m rows follow as pending tokens
  std::vector<const GDNLayer::Token*> rows(m);
  for (size_t l = 0; m > 0 && l < gdn_.size(); ++l) {
    for (int r = 0; r < m; ++r) rows[r] = &draft_gdn_[r][l];
    gdn_[l].append_pending(rows.data(), m, threads_);
  }
  begin_change();  // drops the kept rows: the state moves on
  seq_->set_length(position() + m);
  return m;
}

void Engine::begin_change() {
  tape_parents_.clear();
  draft_tokens_.clear();  // draft_gdn_ keeps its buffers for the next chain
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

void Engine::save_gdn() {
  saved_gdn_.resize(gdn_.size());
  for (size_t i = 0; i < gdn_.size(); ++i) gdn_[i].save(&saved_gdn_[i]);
}

void Engine::restore_gdn() {
  for (size_t i = 0; i < gdn_.size(); ++i) gdn_[i].restore(&saved_gdn_[i]);
}

void Engine::reset() {
  join_fold();
  seq_->truncate(0);
  for (GDNLayer& g : gdn_) g.reset();
  begin_change();
}

void Engine::fill_synthetic(int n, uint64_t seed) {
  join_fold();
  SW_CHECK(n >= 0 && position() + n <= max_context_, "fill_synthetic: ", n, " positions past ",
           position(), " exceed max_context ", max_context_);
  begin_change();
  const int P = position(), Hkv = dims_.n_kv_heads, D = dims_.head_dim;
  seq_->reserve(P + n);
  std::vector<float> k(size_t(Hkv) * D), v(k.size());
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&] {  // xorshift: uniform in [-1, 1)
    z ^= z << 13, z ^= z >> 7, z ^= z << 17;
    return float(int64_t(z >> 11) - (int64_t(1) << 52)) / float(int64_t(1) << 52);
  };
  for (int p = P; p < P + n; ++p)
    for (size_t a = 0; a < tape_.size(); ++a) {
      for (auto& x : k) x = next();
      for (auto& x : v) x = next();
      seq_->write(p, int(a), k.data(), v.data());
    }
  seq_->set_length(P + n);
}

std::shared_ptr<Snapshot> Engine::snapshot() const {
  join_fold();
  auto s = std::make_shared<Snapshot>();
  s->length = position();
  const size_t bytes = pool_->page_bytes();
  const int used = (position() + pool_->page_size() - 1) / pool_->page_size();
  for (int i = 0; i < used; ++i) {  // pages past the length (a draft's) are not state
    const uint8_t* src = pool_->page_data(seq_->page_table()[i]);
    s->pages.emplace_back(src, src + bytes);
  }
  s->gdn = gdn_;
  return s;
}

void Engine::restore(const Snapshot& s) {
  join_fold();
  SW_CHECK(s.gdn.size() == gdn_.size(), "snapshot is from another model");
  SW_CHECK(s.pages.empty() || s.pages[0].size() == pool_->page_bytes(), "snapshot is from another engine");
  seq_->truncate(0);
  seq_->reserve(s.length);
  for (size_t i = 0; i < s.pages.size(); ++i)
    std::memcpy(pool_->page_data(seq_->page_table()[i]), s.pages[i].data(), s.pages[i].size());
  seq_->set_length(s.length);
  gdn_ = s.gdn;
  begin_change();
}

size_t Engine::kv_bytes_used() const { return seq_->page_table().size() * pool_->page_bytes(); }

size_t Engine::gdn_state_bytes() const {
  join_fold();
  size_t b = 0;
  for (const GDNLayer& g : gdn_) b += g.state_bytes();
  return b;
}

}  // namespace sapwood

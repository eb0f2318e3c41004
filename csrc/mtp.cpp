#include "mtp.h"

#include <algorithm>
#include <cmath>

#include "common.h"
#include "thread_pool.h"

namespace sapwood {

namespace {

// fc [H][2H] split by columns: y = fc [e; h] = fc_e e + fc_h h, each half quantized on its own
// (the backend's op list has no concatenation; the halves read the two normed inputs as they
// lie).
void split_fc(WeightLoader& t, int H, WFormat f, QMatrix* fe, QMatrix* fh) {
  t.check_shape("mtp.fc.weight", {H, 2 * H});
  fe->init(H, H, f);
  fh->init(H, H, f);
  t.each_row("mtp.fc.weight", H, 2 * H, [&](int64_t r, const float* x) {
    fe->set_row(int(r), x);
    fh->set_row(int(r), x + H);
  });
}

}  // namespace

MtpHead::MtpHead(const Engine& target, TensorSource& src, WFormat wfmt, KVDtype kv,
                 int max_context, int threads, int page_size, const std::string& backend)
    : target_(target.weights()), dims_(target.dims()), max_context_(max_context),
      threads_(threads > 0 ? threads : default_threads()), fwd_(dims_, weights_) {
  SW_CHECK(max_context > 0, "max_context must be positive, got ", max_context);
  SW_CHECK(dims_.n_heads > 0 && dims_.n_heads % dims_.n_kv_heads == 0 && dims_.head_dim % 32 == 0,
           "the MTP layer's attention needs heads divisible by KV heads and head_dim a multiple of 32");
  dims_.is_attn = {true};
  const int H = dims_.hidden;
  WeightLoader t(src, threads_);
  weights_.layers.push_back(load_layer(dims_, t, "mtp.layers.0.", true, wfmt));
  weights_.final_norm = load_norm(t, "mtp.norm.weight", H);
  pre_e_ = load_norm(t, "mtp.pre_fc_norm_embedding.weight", H);
  pre_h_ = load_norm(t, "mtp.pre_fc_norm_hidden.weight", H);
  split_fc(t, H, wfmt, &fc_e_, &fc_h_);
  be_ = make_backend(backend, dims_, weights_, kv, max_context, page_size, threads_);
  // on a device backend the head holds its own copy of the target's embedding table and LM
  // head: the target engine's backend is another instance, whose buffers it does not share
  be_->add_weights({&target_.embed, &target_.head(), &fc_e_, &fc_h_}, {&pre_e_, &pre_h_});
}

size_t MtpHead::weight_bytes() const {
  return weights_.bytes() + fc_e_.bytes() + fc_h_.bytes() + 4 * (pre_e_.size() + pre_h_.size());
}

void MtpHead::check_rows(const std::vector<float>& hidden, const std::vector<int>& tokens) const {
  SW_CHECK(!tokens.empty(), "no tokens given");
  for (size_t i = 0; i < tokens.size(); ++i)
    SW_CHECK(tokens[i] >= 0 && tokens[i] < dims_.vocab, "token id ", tokens[i], " at index ", i,
             " is outside the vocabulary [0, ", dims_.vocab, ")");
  SW_CHECK(hidden.size() == tokens.size() * size_t(dims_.hidden), "hidden has ", hidden.size(),
           " floats, expected ", tokens.size(), " rows of ", dims_.hidden);
}

Act MtpHead::forward(const float* hidden, const int* tokens, int n, int logit_from,
                     std::vector<float>* logits, std::vector<float>* out_hidden) {
  const int P = position(), H = dims_.hidden, V = dims_.vocab;
  const size_t nh = size_t(n) * H;
  const BatchLayout lay = prefill_layout(P, n);
  const long long macs = (long long)(target_.head().rows) * H + 2LL * H * H +
                         weights_.macs_per_token();  // head() of the layer's weights is empty
  Backend& be = *be_;
  be.set_threads(threads_for((long long)n * macs / 128, threads_));
  be.reserve(P + n);
  Act z{};
  try {
    Act e = be.scratch(Forward::kH, nh), h = be.scratch(Forward::kMix, nh);
    be.embed(target_.embed, tokens, n, e);
    be.rms_norm(e, pre_e_, n, H, dims_.eps, e);
    be.upload(h, hidden, nh);
    be.rms_norm(h, pre_h_, n, H, dims_.eps, h);
    Act x = be.scratch(Forward::kX, nh), xh = be.scratch(Forward::kGate, nh);
    be.matmul(e, n, {{&fc_e_, x}});
    be.matmul(h, n, {{&fc_h_, xh}});
    be.add(x, xh, nh);
    fwd_.run_layers(be, x, lay);
    const int m = n - logit_from;
    Act y = be.scratch(Forward::kH, size_t(m) * H);
    be.rms_norm(x + size_t(logit_from) * H, weights_.final_norm, m, H, dims_.eps, y);
    if (out_hidden) {
      out_hidden->resize(size_t(m) * H);
      be.download(y, size_t(m) * H, out_hidden->data());
    }
    z = be.scratch(Forward::kLogits, size_t(m) * V);
    be.matmul(y, m, {{&target_.head(), z}});
    if (logits) {
      const size_t at = logits->size();
      logits->resize(at + size_t(m) * V);
      be.download(z, size_t(m) * V, logits->data() + at);
    }
  } catch (...) {
    be.truncate(P);
    throw;
  }
  be.set_length(P + n);
  return z;
}

std::vector<float> MtpHead::prefill(const std::vector<float>& hidden, const std::vector<int>& tokens,
                                    bool all_rows, std::vector<float>* out_hidden) {
  Exclusive::Use use(exclusive_, kBusy);
  check_rows(hidden, tokens);
  const int n = int(tokens.size());
  SW_CHECK(position() + n <= max_context_, "MTP head: context full: ", position(), " committed + ",
           n, " rows > max_context ", max_context_);
  std::vector<float> logits;
  forward(hidden.data(), tokens.data(), n, all_rows ? 0 : n - 1, &logits, out_hidden);
  return logits;
}

void MtpHead::draft(const std::vector<float>& hidden, const std::vector<int>& tokens, int rows,
                    int k, double temperature, uint64_t seed, uint64_t key_position,
                    std::vector<int>* ids, std::vector<double>* logp, std::vector<float>* logits) {
  Exclusive::Use use(exclusive_, kBusy);
  check_rows(hidden, tokens);
  SW_CHECK(k >= 1, "MTP draft: k must be >= 1, got ", k);
  SW_CHECK(std::isfinite(temperature) && temperature >= 0.0, "MTP draft: temperature must be "
           "finite and >= 0, got ", temperature);
  const int n = int(tokens.size()), V = dims_.vocab, L = position() + n;  // L: after the commit
  SW_CHECK(rows >= 1 && L + rows - 1 <= max_context_, "MTP draft: ", rows, " rows after position ",
           L, " (max_context ", max_context_, ")");
  // greedy: each row's pick and candidates come from the backend, its logits stay there
  const bool on_backend = temperature <= 0.0 && k <= Backend::kMaxTopK && k <= V && !logits;
  std::vector<float> z, h, h2;
  std::vector<float>* zs = on_backend ? nullptr : &z;
  if (!on_backend) z.reserve(size_t(rows) * V);
  if (on_backend) ids->clear(), logp->clear();
  Act y = forward(hidden.data(), tokens.data(), n, n - 1, zs, &h);  // commits the target's rows
  std::vector<int> chain;
  try {
    for (int r = 0; r < rows; ++r) {
      const int pick = on_backend ? rank_row_on_backend(*be_, y, V, k, ids, logp)
                                  : draft_pick(z.data() + size_t(r) * V, V, temperature, seed,
                                               key_position + uint64_t(r), Engine::kDraftSampleTop);
      chain.push_back(pick);
      if (r + 1 < rows) {  // the next row: this row's output hidden and its pick, one later
        y = forward(h.data(), &pick, 1, 0, zs, &h2);
        h.swap(h2);
      }
    }
  } catch (...) {
    be_->truncate(L);
    throw;
  }
  be_->truncate(L);
  if (on_backend) return;
  rank_draft_rows(z.data(), rows, V, std::min(k, V), chain, ids, logp);
  if (logits) logits->swap(z);
}

bool MtpHead::draft_target(Engine& target, const std::vector<int>& tail, int tail_start,
                           int root, int rows, int k, double temperature, uint64_t seed,
                           std::vector<int>* ids, std::vector<double>* logp, int* need) {
  Exclusive::Use use(exclusive_, kBusy);
  *need = -1;
  const size_t H = size_t(dims_.hidden);
  std::vector<float> fresh;
  const int start = target.take_hidden(&fresh);
  if (start == from_ + int(pending_.size() / H)) {
    pending_.insert(pending_.end(), fresh.begin(), fresh.end());
  } else {  // a gap, or the target was reset: start over at the rows there are
    be_->reset();
    from_ = start;
    pending_.swap(fresh);
  }
  const int n = int(pending_.size() / H), Q = target.position();
  rows = std::min(rows, max_context_ - be_->length() - n + 1);
  if (n == 0 || from_ + n != Q || rows <= 0) return false;  // nothing to read (keep_hidden off)
  if (from_ + 1 < tail_start) {
    *need = from_ + 1;
    return false;
  }
  SW_CHECK(tail_start + int(tail.size()) == Q, "MTP draft: the tail from ", tail_start, " has ",
           tail.size(), " tokens, the target holds ", Q);
  // row j (target position from_ + j) reads the token after it: the context's, then the root
  std::vector<int> tokens(tail.begin() + (from_ + 1 - tail_start), tail.end());
  tokens.push_back(root);
  draft(pending_, tokens, rows, k, temperature, seed, uint64_t(Q) + 1, ids, logp);
  from_ = Q;
  pending_.clear();
  return true;
}

}  // namespace sapwood

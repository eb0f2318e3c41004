#include "gdn_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"
#include "tree.h"

namespace sapwood {

namespace {
void check_finite(const float* x, size_t n, const char* what) {
  // An OR of "all exponent bits set" (inf or NaN) over the words, which vectorises; the
  // element is looked up only on failure (a per-element check showed in a verify's profile).
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof b);
    bad |= uint32_t((b & 0x7f800000u) == 0x7f800000u);
  }
  if (!bad) return;
  for (size_t i = 0; i < n; ++i)
    SW_CHECK(std::isfinite(x[i]), what, " has a non-finite value ", x[i], " at flat index ", i);
}
}  // namespace

GDNLayer::GDNLayer(const GDNDims& d, const float* conv_w, int max_pending)
    : dims_(d), max_pending_(max_pending) {
  SW_CHECK(d.hk > 0 && d.hv > 0 && d.hv % d.hk == 0, "Hv=", d.hv, " must be a multiple of Hk=",
           d.hk);
  SW_CHECK(d.dk > 0 && d.dv > 0 && d.conv_k >= 1, "bad GDN dims dk=", d.dk, " dv=", d.dv,
           " conv_k=", d.conv_k);
  SW_CHECK(max_pending >= 0 && max_pending <= 64, "max_pending must be in [0, 64], got ",
           max_pending);
  const int C = d.channels(), K = d.conv_k;
  conv_w_t_.resize(size_t(K) * C);
  for (int c = 0; c < C; ++c)
    for (int t = 0; t < K; ++t) conv_w_t_[size_t(t) * C + c] = conv_w[size_t(c) * K + t];
  check_finite(conv_w_t_.data(), conv_w_t_.size(), "conv weight");
  reset();
}

void GDNLayer::reset() {
  S_.assign(size_t(dims_.hv) * dims_.dk * dims_.dv, 0.0f);
  window_.assign(size_t(dims_.conv_k - 1) * dims_.channels(), 0.0f);
  // the pending tape and the last forward's rows too: stale ones were read back by the next
  // append (commit, keep_draft) as if they were pending
  pk_.clear(), pv_.clear(), pg_.clear(), pbeta_.clear();
  n_pending_ = 0;
  tape_n_ = 0;
  tape_parents_.clear();
  x_.clear(), q_.clear(), k_.clear(), v_.clear(), g_.clear(), beta_.clear();
}

void GDNLayer::save(Committed* c) const {
  c->S.assign(S_.begin(), S_.end()), c->window.assign(window_.begin(), window_.end());
  c->pk.assign(pk_.begin(), pk_.end()), c->pv.assign(pv_.begin(), pv_.end());
  c->pg.assign(pg_.begin(), pg_.end()), c->pbeta.assign(pbeta_.begin(), pbeta_.end());
  c->n_pending = n_pending_;
}

void GDNLayer::restore(Committed* c) {
  S_.swap(c->S), window_.swap(c->window), pk_.swap(c->pk);
  pv_.swap(c->pv), pg_.swap(c->pg), pbeta_.swap(c->pbeta);
  n_pending_ = c->n_pending;
  tape_n_ = 0;
}

size_t GDNLayer::state_bytes() const {
  return sizeof(float) * (S_.size() + window_.size() + pk_.size() + pv_.size() + pg_.size() +
                          pbeta_.size());
}

void GDNLayer::conv(const float* x, const int* parents, int n, int threads) {
  const GDNDims& d = dims_;
  q_.resize(size_t(n) * d.hk * d.dk);
  k_.resize(size_t(n) * d.hk * d.dk);
  v_.resize(size_t(n) * d.hv * d.dv);
  GDNConvProblem pb{d, n, x, parents, window_.data(), conv_w_t_.data(), q_.data(), k_.data(),
                    v_.data()};
  kernels().gdn_conv(pb, threads);
}

void GDNLayer::run_tree(float* state, const int* parents, int n, float* out, bool chain,
                        int n_pending, int threads) {
  GDNTreeProblem pb{dims_, n, parents, q_.data(), k_.data(), v_.data(), g_.data(), beta_.data(),
                    state, n_pending, pk_.data(), pv_.data(), pg_.data(), pbeta_.data(), out,
                    chain};
  kernels().gdn_tree(pb, threads);
}

void GDNLayer::verify(const float* x, const float* g, const float* beta, const int* parents,
                      int n, float* out, int threads) {
  check_parents(parents, n);
  const GDNDims& d = dims_;
  check_finite(x, size_t(n) * d.channels(), "GDN input x");
  check_finite(g, size_t(n) * d.hv, "GDN decay g");
  check_finite(beta, size_t(n) * d.hv, "GDN beta");
  tape_n_ = 0;
  tape_parents_.assign(parents, parents + n);
  x_.assign(x, x + size_t(n) * d.channels());
  g_.assign(g, g + size_t(n) * d.hv);
  beta_.assign(beta, beta + size_t(n) * d.hv);
  conv(x, parents, n, threads);
  // The pending tokens fold into S itself (the state they stand for does not change), and the
  // tree runs from there: no copy of S per verify.
  run_tree(S_.data(), parents, n, out, /*chain=*/false, n_pending_, threads);
  pk_.clear(), pv_.clear(), pg_.clear(), pbeta_.clear();
  n_pending_ = 0;
  tape_n_ = n;
}

void GDNLayer::fold_oldest(int count, int threads) {
  // Fold pending[0..count) into S_ (a tree of zero nodes with `count` pending tokens).
  run_tree(S_.data(), nullptr, 0, nullptr, true, count, threads);
  const GDNDims& d = dims_;
  auto drop = [&](std::vector<float>& t, size_t per) {
    t.erase(t.begin(), t.begin() + per * count);
  };
  drop(pk_, size_t(d.hk) * d.dk);
  drop(pv_, size_t(d.hv) * d.dv);
  drop(pg_, d.hv);
  drop(pbeta_, d.hv);
  n_pending_ -= count;
}

void GDNLayer::push_pending(const float* k, const float* v, const float* g, const float* beta) {
  const size_t kq = size_t(dims_.hk) * dims_.dk, vv = size_t(dims_.hv) * dims_.dv;
  pk_.insert(pk_.end(), k, k + kq);
  pv_.insert(pv_.end(), v, v + vv);
  pg_.insert(pg_.end(), g, g + dims_.hv);
  pbeta_.insert(pbeta_.end(), beta, beta + dims_.hv);
  ++n_pending_;
}

void GDNLayer::slide_window(const std::vector<const float*>& rows) {
  // the last K-1 rows of [window rows..., rows...], copied once (commits and the draft's
  // keep_draft run this every round; it used to build the whole sequence first)
  const int C = dims_.channels(), W = dims_.conv_k - 1, m = int(rows.size());
  window_next_.resize(size_t(W) * C);
  for (int w = 0; w < W; ++w) {
    const int src = m - W + w;  // < 0: a row of the old window
    const float* p = src >= 0 ? rows[src] : window_.data() + size_t(W + src) * C;
    std::copy(p, p + C, window_next_.begin() + size_t(w) * C);
  }
  window_.swap(window_next_);
}

void GDNLayer::commit(const std::vector<int>& path, int threads) {
  SW_CHECK(tape_n_ > 0, "commit without a preceding verify");
  check_path(tape_parents_.data(), tape_n_, path);
  const GDNDims& d = dims_;
  const int C = d.channels();
  // verify folded the old pending tokens into S: the path's tokens become the pending ones
  const size_t kq = size_t(d.hk) * d.dk, vv = size_t(d.hv) * d.dv;
  std::vector<const float*> inputs;
  for (int node : path) {
    push_pending(&k_[kq * node], &v_[vv * node], &g_[size_t(d.hv) * node],
                 &beta_[size_t(d.hv) * node]);
    inputs.push_back(x_.data() + size_t(C) * node);
  }
  slide_window(inputs);
  tape_n_ = 0;
  if (n_pending_ > max_pending_) fold_oldest(n_pending_ - max_pending_, threads);
}

void GDNLayer::token(int i, Token* t) const {
  const GDNDims& d = dims_;
  SW_CHECK(!g_.empty(), "token before any prefill");
  const int n = int(g_.size()) / d.hv, C = d.channels(), W = d.conv_k - 1;
  SW_CHECK(i >= 0 && i < n && (W == 0 || n - i <= W), "GDN token ", i, " of ", n,
           " rows: its conv input has left the window");
  const size_t kq = size_t(d.hk) * d.dk, vv = size_t(d.hv) * d.dv;
  t->k.assign(k_.begin() + kq * i, k_.begin() + kq * (i + 1));
  t->v.assign(v_.begin() + vv * i, v_.begin() + vv * (i + 1));
  t->g.assign(g_.begin() + size_t(d.hv) * i, g_.begin() + size_t(d.hv) * (i + 1));
  t->beta.assign(beta_.begin() + size_t(d.hv) * i, beta_.begin() + size_t(d.hv) * (i + 1));
  if (W > 0) {  // prefill slid it in: row W - (n - i) of the window
    const auto row = window_.begin() + size_t(W - (n - i)) * C;
    t->x.assign(row, row + C);
  } else {
    t->x.clear();
  }
}

void GDNLayer::append_pending(const Token* const* tokens, int m, int threads) {
  std::vector<const float*> inputs;
  for (int i = 0; i < m; ++i) {
    const Token& t = *tokens[i];
    push_pending(t.k.data(), t.v.data(), t.g.data(), t.beta.data());
    inputs.push_back(t.x.data());
  }
  slide_window(inputs);
  tape_n_ = 0;
  if (n_pending_ > max_pending_) fold_oldest(n_pending_ - max_pending_, threads);
}

void GDNLayer::prefill(const float* x, const float* g, const float* beta, int n, float* out,
                       int threads) {
  SW_CHECK(n > 0, "prefill needs at least one token");
  const GDNDims& d = dims_;
  check_finite(x, size_t(n) * d.channels(), "GDN input x");
  check_finite(g, size_t(n) * d.hv, "GDN decay g");
  check_finite(beta, size_t(n) * d.hv, "GDN beta");
  tape_n_ = 0;
  std::vector<int> chain(n);
  for (int i = 0; i < n; ++i) chain[i] = i - 1;
  g_.assign(g, g + size_t(n) * d.hv);
  beta_.assign(beta, beta + size_t(n) * d.hv);
  conv(x, chain.data(), n, threads);
  run_tree(S_.data(), chain.data(), n, out, /*chain=*/true, n_pending_, threads);
  pk_.clear(), pv_.clear(), pg_.clear(), pbeta_.clear();
  n_pending_ = 0;
  std::vector<const float*> inputs(n);
  for (int i = 0; i < n; ++i) inputs[i] = x + size_t(i) * d.channels();
  slide_window(inputs);
}

std::vector<float> GDNLayer::folded_state(int threads) const {
  GDNLayer copy(*this);
  copy.fold_oldest(copy.n_pending_, threads);
  return copy.S_;
}

}  // namespace sapwood

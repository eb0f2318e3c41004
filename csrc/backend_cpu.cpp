#include "backend_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"
#include "kernels/kernels.h"

namespace sapwood {

namespace {
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
Act host(float* p) { return Act{p, nullptr, 0}; }
}  // namespace

CpuBackend::CpuBackend(const ModelDims& d, const ModelWeights& w, KVDtype kv, int max_context,
                       int page_size, int threads)
    : d_(d), w_(w), kv_(kv), page_size_(page_size), threads_(threads) {
  const int pages = (max_context + page_size - 1) / page_size;
  pool_ = std::make_shared<KVPagePool>(pages, page_size, std::max(1, d.n_attn()),
                                       std::max(1, d.n_kv_heads), std::max(32, d.head_dim), kv);
  seq_ = std::make_unique<KVSequence>(pool_);
  // A committed path of up to 32 draft rows and its root stays pending (the decoder drafts at
  // most 32 rows): the next verify folds it inside its own GDN region instead of commit
  // running one more parallel region a layer.
  constexpr int kMaxPending = 33;
  for (int l = 0; l < d.n_layers(); ++l)
    if (!d.is_attn[l]) gdn_.emplace_back(d.gdn(), w.layers[l].conv_w.data(), kMaxPending);
  tape_.resize(d.n_attn());
  bufs_.resize(Forward::kBufs);
}

Act CpuBackend::scratch(int id, size_t n) {
  std::vector<float>& b = bufs_.at(size_t(id));
  if (b.size() < n) b.resize(n);
  return host(b.data());
}

// n == 0 comes with null pointers (an empty vector's data()): memcpy's are then UB (UBSan)
void CpuBackend::upload(Act dst, const float* src, size_t n) {
  if (n && dst.p != src) std::memcpy(dst.p, src, n * sizeof(float));
}

void CpuBackend::download(Act src, size_t n, float* dst) {
  if (n) std::memcpy(dst, src.p, n * sizeof(float));
}

void CpuBackend::copy(Act dst, Act src, size_t n) {
  if (n) std::memcpy(dst.p, src.p, n * sizeof(float));
}

void CpuBackend::embed(const QMatrix& table, const int* tokens, int n, Act x) {
  for (int i = 0; i < n; ++i) table.dequant_row(tokens[i], x.p + size_t(i) * table.cols);
}

namespace {
void set_id(Act ids, size_t i, int v) { std::memcpy(ids.p + i, &v, sizeof v); }  // int32 bits
}  // namespace

void CpuBackend::top_k_rows(Act x, int rows, int cols, int k, Act ids, Act vals) {
  SW_CHECK(k >= 1 && k <= kMaxTopK && k <= cols, "top_k_rows: k=", k, " (1..", kMaxTopK,
           ", <= cols ", cols, ")");
  std::vector<int> out(static_cast<size_t>(k));
  for (int r = 0; r < rows; ++r) {
    const float* row = x.p + size_t(r) * cols;
    std::fill(out.begin(), out.end(), -1);  // top_ids fills only as many as are not NaN
    kernels().top_ids(row, cols, k, -1, out.data());
    for (int j = 0; j < k; ++j) {
      set_id(ids, size_t(r) * k + j, out[size_t(j)]);
      vals.p[size_t(r) * k + j] = out[size_t(j)] >= 0 ? row[out[size_t(j)]] : 0.0f;
    }
  }
}

void CpuBackend::logsumexp_rows(Act x, int rows, int cols, Act out) {
  for (int r = 0; r < rows; ++r)
    out.p[r] = float(kernels().logsumexp(x.p + size_t(r) * cols, size_t(cols)));
}

void CpuBackend::rms_norm(Act x, const std::vector<float>& w, int n, int dim, float eps, Act out) {
  kernels().rms_norm(x.p, w.data(), n, dim, eps, out.p);
}

void CpuBackend::add(Act x, Act y, size_t n) {
  for (size_t i = 0; i < n; ++i) x.p[i] += y.p[i];
}

void CpuBackend::silu_mul(Act x, Act u, Act out, size_t n) { kernels().silu_mul(x.p, u.p, out.p, n); }

void CpuBackend::sigmoid_mul(Act x, Act u, Act out, size_t n) {
  kernels().sigmoid_mul(x.p, u.p, out.p, n);
}

void CpuBackend::split_q_gate(Act qg, int n, int heads, int dim, Act q, Act gate) {
  for (size_t r = 0; r < size_t(n) * heads; ++r) {
    const float* src = qg.p + r * 2 * dim;
    std::copy(src, src + dim, q.p + r * dim);
    std::copy(src + dim, src + 2 * dim, gate.p + r * dim);
  }
}

void CpuBackend::rope(Act x, int n, int heads, int dim, int rot, Act cs) {
  const int half = rot / 2;
  for (int r = 0; r < n; ++r) {
    const float* c = cs.p + size_t(r) * 2 * half;
    for (int i = 0; i < half; ++i) {
      const float co = c[2 * i], si = c[2 * i + 1];
      for (int h = 0; h < heads; ++h) {
        float* xh = x.p + (size_t(r) * heads + h) * dim;
        const float a = xh[i], b = xh[i + half];
        xh[i] = a * co - b * si;
        xh[i + half] = b * co + a * si;
      }
    }
  }
}

void CpuBackend::gdn_gates(Act ba, int n, int hv, const std::vector<float>& neg_exp_a,
                           const std::vector<float>& dt_bias, Act beta, Act g) {
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < hv; ++j) {
      beta.p[size_t(i) * hv + j] = sigmoid(ba.p[size_t(i) * 2 * hv + j]);
      g.p[size_t(i) * hv + j] = neg_exp_a[j] * softplus(ba.p[size_t(i) * 2 * hv + hv + j] + dt_bias[j]);
    }
}

void CpuBackend::matmul(Act x, int n, std::initializer_list<std::pair<const QMatrix*, Act>> outs) {
  // One quantization of x and one parallel region for every matrix that reads it (qkv|z,
  // gate|up, q|k|v): one hand-off and one tail instead of one per matrix.
  SW_CHECK(outs.size() >= 1 && outs.size() <= size_t(kMaxMatmuls), "1 to ", kMaxMatmuls,
           " matrices a region, got ", outs.size());
  const QMatrix& w = *outs.begin()->first;
  if (w.fmt == WFormat::Q8 || w.fmt == WFormat::Q4) acts_.quantize(x.p, n, w.cols, w.cols_pad);
  MatmulProblem pbs[kMaxMatmuls];
  int count = 0;
  for (const auto& [wi, y] : outs) pbs[count++] = MatmulProblem{wi, x.p, &acts_, n, y.p};
  kernels().matmul(pbs, count, threads_);
}

Act CpuBackend::kv_rows(int a, int n, bool values) {
  std::vector<float>& t = values ? tape_[a].v : tape_[a].k;
  t.resize(size_t(n) * d_.n_kv_heads * d_.head_dim);
  return host(t.data());
}

void CpuBackend::attend(int a, Act q, const BatchLayout& lay, Act out) {
  const int n = lay.n, D = d_.head_dim, Hq = d_.n_heads, Hkv = d_.n_kv_heads;
  KVTape& tape = tape_[a];
  const float *kt = nullptr, *vt = nullptr;  // the tree rows' keys and values (verify only)
  if (lay.prefill) {
    // The rows are positions hist_len - n .. hist_len - 1, committed as they go: their keys
    // and values are written to pages first and read back from there like any history.
    const int start = lay.hist_len - n;
    for (int i = 0; i < n; ++i)
      seq_->write(start + i, a, tape.k.data() + size_t(i) * Hkv * D, tape.v.data() + size_t(i) * Hkv * D);
  } else {
    // Tree rows see each other's keys as the cache will hold them: int8-roundtripped.
    const KVDtype dt = pool_->dtype();
    kt_.resize(tape.k.size());
    vt_.resize(tape.v.size());
    for (size_t r = 0; r < size_t(n) * Hkv; ++r) {
      kv_roundtrip(tape.k.data() + r * D, D, dt, kt_.data() + r * D);
      kv_roundtrip(tape.v.data() + r * D, D, dt, vt_.data() + r * D);
    }
    kt = kt_.data(), vt = vt_.data();
    if (dt == KVDtype::Int8) quantize_tree_keys(tape.k.data(), size_t(n) * Hkv, D, &kq_, &ks_);
  }
  AttnProblem pb{n, Hq, Hkv, D, q.p, out.p, lay.row_len.data(), lay.hist_len, seq_.get(),
                 a, kt, vt, lay.anc.data(), lay.anc_stride, kAttnSplit,
                 1.0f / std::sqrt(float(D))};
  if (!lay.prefill && pool_->dtype() == KVDtype::Int8) pb.kq_tree = kq_.data(), pb.ks_tree = ks_.data();
  kernels().tree_attention(pb, threads_);
}

void CpuBackend::gdn(int g, Act qkv, Act decay, Act beta, const BatchLayout& lay, Act out) {
  if (lay.prefill)
    gdn_[g].prefill(qkv.p, decay.p, beta.p, lay.n, out.p, threads_);
  else
    gdn_[g].verify(qkv.p, decay.p, beta.p, lay.parents.data(), lay.n, out.p, threads_);
}

void CpuBackend::commit(int P, const std::vector<int>& path) {
  const int Hkv = d_.n_kv_heads, D = d_.head_dim, m = int(path.size());
  for (size_t a = 0; a < tape_.size(); ++a)
    for (int j = 0; j < m; ++j)
      seq_->write(P + j, int(a), tape_[a].k.data() + size_t(path[j]) * Hkv * D,
                  tape_[a].v.data() + size_t(path[j]) * Hkv * D);
  seq_->set_length(P + m);
  for (GDNLayer& g : gdn_) g.commit(path, threads_);
}

void CpuBackend::save_gdn() {
  // into the same buffers every time: a draft chain saves once per chain, and fresh vectors
  // would cost an allocation and a free per buffer each time
  saved_gdn_.resize(gdn_.size());
  for (size_t i = 0; i < gdn_.size(); ++i) gdn_[i].save(&saved_gdn_[i]);
}

void CpuBackend::restore_gdn() {
  for (size_t i = 0; i < gdn_.size(); ++i) gdn_[i].restore(&saved_gdn_[i]);
}

void CpuBackend::fold_pending(int threads) {
  for (GDNLayer& g : gdn_) g.fold_pending(threads);
}

void CpuBackend::reset() {
  seq_->truncate(0);
  for (GDNLayer& g : gdn_) g.reset();
}

void CpuBackend::keep_row(int slot, int row) {
  if (kept_.size() <= size_t(slot)) kept_.resize(size_t(slot) + 1);
  kept_[slot].resize(gdn_.size());
  for (size_t l = 0; l < gdn_.size(); ++l) gdn_[l].token(row, &kept_[slot][l]);
}

void CpuBackend::append_kept(const std::vector<int>& slots, int threads) {
  std::vector<const GDNLayer::Token*> rows(slots.size());
  for (size_t l = 0; !slots.empty() && l < gdn_.size(); ++l) {
    for (size_t r = 0; r < slots.size(); ++r) rows[r] = &kept_.at(size_t(slots[r]))[l];
    gdn_[l].append_pending(rows.data(), int(rows.size()), threads);
  }
}

void CpuBackend::write_kv(int a, int P, int n, const float* k, const float* v) {
  const size_t row = size_t(d_.n_kv_heads) * d_.head_dim;
  for (int i = 0; i < n; ++i) seq_->write(P + i, a, k + i * row, v + i * row);
}

void CpuBackend::snapshot(Snapshot* s) const {
  const size_t bytes = pool_->page_bytes();
  const int used = (length() + pool_->page_size() - 1) / pool_->page_size();
  for (int i = 0; i < used; ++i) {  // pages past the length (a draft's) are not state
    const uint8_t* src = pool_->page_data(seq_->page_table()[i]);
    s->pages.emplace_back(src, src + bytes);
  }
  // per layer: n_pending, then S, window and the pending tape as GDNLayer::save lays them out
  for (const GDNLayer& g : gdn_) {
    GDNLayer::Committed c;
    g.save(&c);
    std::vector<float> blob{float(c.n_pending)};
    for (const std::vector<float>* part : {&c.S, &c.window, &c.pk, &c.pv, &c.pg, &c.pbeta})
      blob.insert(blob.end(), part->begin(), part->end());
    s->gdn.push_back(std::move(blob));
  }
}

void CpuBackend::restore(const Snapshot& s) {
  // Validate every blob before changing anything: a failed restore leaves the engine as it was.
  const size_t page_bytes = pool_->page_bytes();
  SW_CHECK(s.gdn.size() == gdn_.size(), "snapshot has ", s.gdn.size(), " GDN layers, this model ",
           gdn_.size());
  const int ps = pool_->page_size();
  SW_CHECK(s.length >= 0 && s.length <= pool_->num_pages() * ps, "snapshot of ", s.length,
           " positions does not fit this engine's ", pool_->num_pages() * ps);
  SW_CHECK(s.pages.size() == size_t((s.length + ps - 1) / ps), "snapshot has ", s.pages.size(),
           " pages for ", s.length, " positions");
  for (const auto& p : s.pages)
    SW_CHECK(p.size() == page_bytes, "snapshot page of ", p.size(), " bytes, this engine's are ", page_bytes);
  std::vector<GDNLayer::Committed> cs(gdn_.size());
  for (size_t l = 0; l < gdn_.size(); ++l) {
    const GDNDims& dd = gdn_[l].dims();
    const std::vector<float>& b = s.gdn[l];
    SW_CHECK(!b.empty(), "empty GDN state in snapshot");
    const int np = int(b[0]);
    const size_t nS = size_t(dd.hv) * dd.dk * dd.dv, nW = size_t(dd.conv_k - 1) * dd.channels();
    const size_t nk = size_t(np) * dd.hk * dd.dk, nv = size_t(np) * dd.hv * dd.dv, ng = size_t(np) * dd.hv;
    SW_CHECK(float(np) == b[0] && np >= 0 && b.size() == 1 + nS + nW + nk + nv + 2 * ng,
             "snapshot GDN layer ", l, " does not match this model's dims");
    GDNLayer::Committed& c = cs[l];
    const float* p = b.data() + 1;
    for (auto [part, n] : {std::pair{&c.S, nS}, {&c.window, nW}, {&c.pk, nk}, {&c.pv, nv},
                           {&c.pg, ng}, {&c.pbeta, ng}}) {
      part->assign(p, p + n);
      p += n;
    }
    c.n_pending = np;
  }
  seq_->truncate(0);
  seq_->reserve(s.length);
  for (size_t i = 0; i < s.pages.size(); ++i)
    std::memcpy(pool_->page_data(seq_->page_table()[i]), s.pages[i].data(), s.pages[i].size());
  seq_->set_length(s.length);
  for (size_t l = 0; l < gdn_.size(); ++l) gdn_[l].restore(&cs[l]);
}

size_t CpuBackend::gdn_state_bytes() const {
  size_t b = 0;
  for (const GDNLayer& g : gdn_) b += g.state_bytes();
  return b;
}

}  // namespace sapwood

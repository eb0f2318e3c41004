#include "gpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../../metal/sw_common.h"
#include "../../metal/sw_plan.h"
#include "../common.h"
#include "launch.h"

namespace sapwood {

using gpu::blocks;
using gpu::buf;
using gpu::grid;
using gpu::round32;
using gpu::val;
namespace {
constexpr int kQ8Threads = SW_Q8_THREADS, kQ8Rows = SW_Q8_MAX_ROWS;
}  // namespace

GpuBackend::GpuBackend(std::unique_ptr<gpu::Device> dev, const ModelDims& d,
                       const ModelWeights& w, KVDtype kv, int max_context, int page_size)
    : GpuBackend(std::make_shared<Shared>(std::move(dev)), d, w, kv, max_context, page_size) {
  upload_weights();
}

std::unique_ptr<Backend> GpuBackend::new_sequence(int max_context, int) const {
  std::lock_guard<std::recursive_mutex> hold(shared_->lock);  // allocates on the shared device
  return std::unique_ptr<Backend>(new GpuBackend(shared_, d_, w_, kv_dtype_, max_context, page_size_));
}

GpuBackend::GpuBackend(std::shared_ptr<Shared> shared, const ModelDims& d, const ModelWeights& w,
                       KVDtype kv, int max_context, int page_size)
    : shared_(std::move(shared)), dev_(shared_->dev.get()), name_(dev_->name()), d_(d), w_(w),
      kv_dtype_(kv), page_size_(page_size) {
  SW_CHECK(kv == KVDtype::Int8, "the ", name_, " backend keeps KV in int8 pages only (kv='int8')");
  SW_CHECK(page_size % SW_ATTN_TILE == 0, "page_size must be a multiple of ", int(SW_ATTN_TILE));
  SW_CHECK(d.n_attn() == 0 || (d.head_dim <= SW_MAX_HEAD_DIM && d.head_dim % SW_KV_GROUP == 0),
           "the ", name_, " backend needs head_dim a multiple of 32 up to ", int(SW_MAX_HEAD_DIM),
           ", got ", d.head_dim);
  SW_CHECK(d.n_attn() == d.n_layers() ||
               (d.dk <= SW_GDN_MAX_DK && d.dv <= SW_GDN_MAX_W && d.conv_k >= 2 && d.conv_k <= SW_GDN_MAX_K),
           "the ", name_, " backend needs GDN dk <= ", int(SW_GDN_MAX_DK), ", dv <= ", int(SW_GDN_MAX_W),
           " and conv_k in 2..", int(SW_GDN_MAX_K));
  num_pages_ = (max_context + page_size - 1) / page_size;
  for (int i = num_pages_ - 1; i >= 0; --i) free_.push_back(i);
  scratch_.resize(Forward::kBufs);
  empty_ = alloc(64);
  const int C = d.conv_dim(), K = d.conv_k;
  for (int l = 0; l < d.n_layers(); ++l) {
    if (d.is_attn[l]) {
      KVLayer kl;
      const size_t vals = size_t(num_pages_) * page_floats();
      kl.k = alloc(vals), kl.v = alloc(vals);
      kl.ks = alloc(vals / SW_KV_GROUP * 4), kl.vs = alloc(vals / SW_KV_GROUP * 4);
      kv_.push_back(std::move(kl));
    } else {
      GDNState g;
      g.S = alloc(sizeof(float) * d.hv * d.dk * d.dv);
      g.window = alloc(sizeof(float) * (K - 1) * C);
      g.window_next = alloc(sizeof(float) * (K - 1) * C);
      gdn_.push_back(std::move(g));
    }
  }
}

void GpuBackend::upload_weights() {
  upload_matrix(w_.embed);
  if (w_.lm_head.rows) upload_matrix(w_.lm_head);
  upload_vec(w_.final_norm);
  const int C = d_.conv_dim(), K = d_.conv_k;
  for (int l = 0; l < d_.n_layers(); ++l) {
    const LayerWeights& L = w_.layers[l];
    for (const QMatrix* m : L.matrices())
      if (m->rows) upload_matrix(*m);
    for (const std::vector<float>* v : {&L.in_norm, &L.post_norm, &L.q_norm, &L.k_norm, &L.gnorm,
                                        &L.neg_exp_a, &L.dt_bias})
      if (!v->empty()) upload_vec(*v);
    if (!d_.is_attn[l]) {
      std::vector<float> cw(size_t(K) * C);  // HF [C][1][K] -> the kernel's [K][C]
      for (int c = 0; c < C; ++c)
        for (int t = 0; t < K; ++t) cw[size_t(t) * C + c] = L.conv_w[size_t(c) * K + t];
      put(&shared_->conv_w.emplace_back(), cw.data(), cw.size() * 4);
    }
  }
}

GpuBackend::Shared::~Shared() {
  auto rel = [&](gpu::Buffer& b) {
    if (b.handle) dev->release(b);
  };
  for (auto& [k, m] : mats) rel(m.w), rel(m.scale), rel(m.bias);
  for (auto& [k, b] : vecs) rel(b);
  for (auto& b : conv_w) rel(b);
}

GpuBackend::~GpuBackend() {
  std::lock_guard<std::recursive_mutex> hold(shared_->lock);  // a sibling may run meanwhile
  auto rel = [&](gpu::Buffer& b) {
    if (b.handle) dev_->release(b);
  };
  for (auto& b : scratch_) rel(b);
  for (auto& l : kv_)
    for (gpu::Buffer* b : {&l.k, &l.v, &l.ks, &l.vs, &l.tk, &l.tv}) rel(*b);
  for (auto& g : gdn_)
    for (gpu::Buffer* b : {&g.S, &g.window, &g.window_next, &g.x, &g.node_state}) rel(*b);
  for (gpu::Buffer* b : {&tokens_, &parents_, &anc_, &row_len_, &path_, &ident_, &table_buf_, &xq_,
                         &xs_, &part_, &kt8_, &kts_, &vt8_, &vts_, &gq_, &gk_, &gv_, &tmp_, &empty_,
                         &skip_})
    rel(*b);
}

// ---- buffers ----

gpu::Buffer GpuBackend::alloc(size_t bytes) { return dev_->alloc(std::max<size_t>(bytes, 16)); }

void GpuBackend::ensure(gpu::Buffer* b, size_t bytes) {
  if (b->handle && b->bytes >= bytes) return;
  if (b->handle) dev_->release(*b);
  *b = alloc(bytes + bytes / 2);  // headroom: activations grow with the rows of a forward
}

void GpuBackend::put(gpu::Buffer* b, const void* src, size_t bytes) {
  ensure(b, bytes);
  std::memcpy(b->host, src, bytes);
}

// A wait with nothing queued is skipped: the queue is the siblings' (Shared), so is the flag.
void GpuBackend::sync() const {
  if (!shared_->pending) return;
  dev_->wait();
  shared_->pending = false;
  ++syncs_;
}

void GpuBackend::run(const char* kernel, const std::vector<gpu::Arg>& args, gpu::Launch l) {
  dev_->dispatch(dev_->pipeline(kernel), args, l);
  shared_->pending = true;
}

gpu::Arg GpuBackend::arg(Act a) {
  return gpu::Arg::of(*static_cast<const gpu::Buffer*>(a.buf), a.off * sizeof(float));
}

Act GpuBackend::scratch(int id, size_t n) {
  gpu::Buffer& b = scratch_.at(size_t(id));
  ensure(&b, n * sizeof(float));
  return Act{static_cast<float*>(b.host), &b, 0};
}

void GpuBackend::upload(Act dst, const float* src, size_t n) {
  std::memcpy(dst.p, src, n * sizeof(float));
}

void GpuBackend::copy(Act dst, Act src, size_t n) {
  // gather_rows of one row of n floats at index 0 (empty_ is zero-filled)
  SW_CHECK(n <= size_t(INT32_MAX), "copy of ", n, " floats");
  if (n) gather(arg(src), empty_, 1, int(n), arg(dst));
}

void GpuBackend::download(Act src, size_t n, float* dst) {
  sync();
  std::memcpy(dst, src.p, n * sizeof(float));
}

const GpuBackend::Mat& GpuBackend::mat(const QMatrix* m) const {
  auto it = shared_->mats.find(m);
  SW_CHECK(it != shared_->mats.end(), "matrix not uploaded to the ", name_, " backend");
  return it->second;
}

const gpu::Buffer& GpuBackend::vec(const std::vector<float>& v) const {
  auto it = shared_->vecs.find(&v);
  SW_CHECK(it != shared_->vecs.end(), "vector not uploaded to the ", name_, " backend");
  return it->second;
}

void GpuBackend::upload_vec(const std::vector<float>& v) { put(&shared_->vecs[&v], v.data(), v.size() * 4); }

void GpuBackend::add_weights(const std::vector<const QMatrix*>& mats,
                             const std::vector<const std::vector<float>*>& vecs) {
  std::lock_guard<std::recursive_mutex> hold(shared_->lock);  // the siblings' weights too
  for (const QMatrix* m : mats)
    if (m->rows && !shared_->mats.count(m)) upload_matrix(*m);
  for (const std::vector<float>* v : vecs)
    if (!v->empty() && !shared_->vecs.count(v)) upload_vec(*v);
}

void GpuBackend::upload_matrix(const QMatrix& m) {
  Mat g{m.fmt, m.rows, m.cols, m.cols_pad, {}, {}};
  g.group = m.group, g.affine = m.affine();
  const size_t R = size_t(m.rows), Cc = size_t(m.cols);
  switch (m.fmt) {
    case WFormat::F32:
    case WFormat::BF16: {  // the CPU packs [rows/16][cols][16]: back to row-major
      std::vector<float> f(R * Cc);
      for (size_t r = 0; r < R; ++r) m.dequant_row(int(r), f.data() + r * Cc);
      if (m.fmt == WFormat::F32) {
        put(&g.w, f.data(), f.size() * 4);
      } else {
        std::vector<uint16_t> b(f.size());
        for (size_t i = 0; i < f.size(); ++i) b[i] = f32_to_bf16(f[i]);  // exact: f is bf16
        put(&g.w, b.data(), b.size() * 2);
      }
      break;
    }
    case WFormat::Q8: {  // quads of 16-output groups -> [rows][cols_pad] int8
      std::vector<int8_t> q(R * m.cols_pad, 0);
      for (size_t r = 0; r < R; ++r)
        for (int k = 0; k < m.cols; ++k) q[r * m.cols_pad + k] = m.q8[m.q8_index(int(r), k)];
      put(&g.w, q.data(), q.size());
      put(&g.scale, m.scale.data(), R * 4);
      break;
    }
    case WFormat::Q4: {  // [rows][cols_pad / 2] nibbles + [rows][groups] scales (and biases)
      std::vector<uint8_t> nib;
      std::vector<float> sc, bi;
      m.q4_plain(&nib, &sc, &bi);
      put(&g.w, nib.data(), nib.size());
      put(&g.scale, sc.data(), sc.size() * 4);
      if (m.affine()) put(&g.bias, bi.data(), bi.size() * 4);
      break;
    }
  }
  shared_->mats[&m] = std::move(g);
}

size_t GpuBackend::page_floats() const {
  return size_t(std::max(1, d_.n_kv_heads)) * page_size_ * std::max(32, d_.head_dim);
}

// ---- stateless ops ----

void GpuBackend::embed(const QMatrix& table, const int* tokens, int n, Act x) {
  put(&tokens_, tokens, size_t(n) * 4);
  const Mat& m = mat(&table);
  const SwEmbedParams p{n, m.cols, m.cols_pad, m.rows, m.group, m.affine};
  if (m.fmt == WFormat::F32 || m.fmt == WFormat::BF16)
    run(m.fmt == WFormat::F32 ? "embed_rows_f32" : "embed_rows_bf16", {buf(tokens_), buf(m.w), arg(x), val(p)},
        grid(n, 1, 256));
  else if (m.fmt == WFormat::Q8)
    run("embed_rows_q8", {buf(tokens_), buf(m.w), buf(m.scale), arg(x), val(p)}, grid(n, 1, 256));
  else
    run("embed_rows_q4", {buf(tokens_), buf(m.w), buf(m.scale), buf(m.bias_or_scale()), arg(x), val(p)},
        grid(n, 1, 256));
}

// rows.metal's drafting kernels: a threadgroup of 256 threads a row; their threadgroup memory
// is a value and an index per simdgroup (top_k), or SW_LSE_LANES partial sums (logsumexp)
void GpuBackend::top_k_rows(Act x, int rows, int cols, int k, Act ids, Act vals) {
  SW_CHECK(k >= 1 && k <= kMaxTopK && k <= SW_TOPK_MAX && k <= cols, "top_k_rows: k=", k,
           " (1..", kMaxTopK, ", <= cols ", cols, ")");
  const std::vector<int> none(size_t(rows), -1);  // no id skipped
  put(&skip_, none.data(), none.size() * 4);
  const SwRowsParams p{rows, cols, k, 0.0f};
  const size_t sg = 256 / 32 * 4;
  run("top_k_rows", {arg(x), buf(skip_), arg(ids), arg(vals), val(p)}, grid(rows, 1, 256, {sg, sg}));
}

void GpuBackend::logsumexp_rows(Act x, int rows, int cols, Act out) {
  const SwRowsParams p{rows, cols, 0, 0.0f};
  run("logsumexp_rows", {arg(x), arg(out), val(p)},
      grid(rows, 1, 256, {sizeof(float) * SW_LSE_LANES}));
}

void GpuBackend::rms_norm(Act x, const std::vector<float>& w, int n, int dim, float eps, Act out) {
  const SwRowsParams p{n, dim, 0, eps};
  run("rms_norm", {arg(x), buf(vec(w)), arg(out), val(p)}, grid(n, 1, 256));
}

// the flat ops: element i = group * 256 + thread
void GpuBackend::add(Act x, Act y, size_t n) {
  const SwEltParams p{int(n), 0, 0, 0};
  run("add_inplace", {arg(x), arg(y), val(p)}, grid(blocks(n, 256), 1, 256));
}

void GpuBackend::silu_mul(Act x, Act u, Act out, size_t n) {
  const SwEltParams p{int(n), 0, 0, 0};
  run("silu_mul", {arg(x), arg(u), arg(out), val(p)}, grid(blocks(n, 256), 1, 256));
}

void GpuBackend::sigmoid_mul(Act x, Act u, Act out, size_t n) {
  const SwEltParams p{int(n), 0, 0, 0};
  run("sigmoid_mul", {arg(x), arg(u), arg(out), val(p)}, grid(blocks(n, 256), 1, 256));
}

void GpuBackend::split_q_gate(Act qg, int n, int heads, int dim, Act q, Act gate) {
  const SwEltParams p{n, heads, dim, 0};
  run("split_q_gate", {arg(qg), arg(q), arg(gate), val(p)},
      grid(blocks(size_t(n) * heads * dim, 256), 1, 256));
}

void GpuBackend::rope(Act x, int n, int heads, int dim, int rot, Act cs) {
  if (rot < 2) return;
  const SwEltParams p{n, heads, dim, rot};
  run("rope", {arg(x), arg(cs), val(p)}, grid(blocks(size_t(n) * heads * (rot / 2), 256), 1, 256));
}

void GpuBackend::gdn_gates(Act ba, int n, int hv, const std::vector<float>& neg_exp_a,
                           const std::vector<float>& dt_bias, Act beta, Act g) {
  const SwEltParams p{n, hv, 0, 0};
  run("gdn_gates", {arg(ba), buf(vec(dt_bias)), buf(vec(neg_exp_a)), arg(beta), arg(g), val(p)},
      grid(blocks(size_t(n) * hv, 256), 1, 256));
}

void GpuBackend::matmul(Act x, int n, std::initializer_list<std::pair<const QMatrix*, Act>> outs) {
  // Launches of at most 16 rows, each reading every weight once; a row's result does not
  // depend on the launch it is in (the kernels' orders are fixed by the dims).
  // x is quantized once for every q8/q4 matrix that reads it (qkv and z; ba stays fp32)
  const Mat* q = nullptr;
  for (const auto& [qm, y] : outs)
    if (mat(qm).fmt == WFormat::Q8 || mat(qm).fmt == WFormat::Q4) q = &mat(qm);
  if (q) {
    ensure(&xq_, size_t(n) * q->cols_pad), ensure(&xs_, size_t(n) * 4);
    const SwQ8Params p{n, q->cols, q->cols_pad, 0};
    run("q8_quantize_rows", {arg(x), buf(xq_), buf(xs_), val(p)},
        grid(n, 1, kQ8Threads, {sizeof(float) * (kQ8Threads / 32)}));
  }
  for (const auto& [qm, y] : outs) {
    const Mat& m = mat(qm);
    const bool quant = m.fmt == WFormat::Q8 || m.fmt == WFormat::Q4;
    SW_CHECK(!quant || m.cols_pad == q->cols_pad, "matrices of one matmul share x");
    for (int r0 = 0; r0 < n; r0 += kQ8Rows) {
      const int rows = std::min(kQ8Rows, n - r0);
      const Act yr = y + size_t(r0) * m.rows;
      if (m.fmt == WFormat::Q8) {  // a simdgroup an output
        const SwQ8Params p{rows, m.cols, m.cols_pad, m.rows};
        run("q8_matmul", {buf(m.w), buf(m.scale), buf(xq_, size_t(r0) * m.cols_pad), buf(xs_, size_t(r0) * 4),
                          arg(yr), val(p)},
            grid(blocks(m.rows, kQ8Threads / 32), 1, kQ8Threads));
      } else if (m.fmt == WFormat::Q4) {  // 8 lanes an output, 4 a simdgroup
        const SwQ4Params p{rows, m.cols_pad, m.rows, m.group, m.affine};
        run("q4_matmul", {buf(m.w), buf(m.scale), buf(m.bias_or_scale()), buf(xq_, size_t(r0) * m.cols_pad),
                          buf(xs_, size_t(r0) * 4), arg(yr), val(p)},
            grid(blocks(m.rows, kQ8Threads / 8), 1, kQ8Threads));
      } else {
        const SwQ8Params p{rows, m.cols, m.cols, m.rows};
        run(m.fmt == WFormat::F32 ? "matmul_f32" : "matmul_bf16",
            {buf(m.w), arg(x + size_t(r0) * m.cols), arg(yr), val(p)},
            grid(blocks(m.rows, kQ8Threads / 32), 1, kQ8Threads));
      }
    }
  }
}

}  // namespace sapwood

// GpuBackend's sequence state: int8 KV pages and tree attention, pathwise GDN, commit,
// save/restore and snapshots (gpu_backend.h). The planning of a tree-attention launch is
// metal/sw_plan.h's, the one the emulator's own launcher uses.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../../metal/sw_common.h"
#include "../../metal/sw_plan.h"
#include "../common.h"
#include "launch.h"
#include "gpu_backend.h"

namespace sapwood {

using gpu::blocks;
using gpu::buf;
using gpu::grid;
using gpu::round32;
using gpu::val;

// ---- pages ----

void GpuBackend::reserve(int n) {
  const int need = (n + page_size_ - 1) / page_size_ - int(table_.size());
  if (need <= 0) return;
  SW_CHECK(need <= int(free_.size()), "KV cache full: ", n, " positions need ", need,
           " more pages, ", free_.size(), " free");
  for (int i = 0; i < need; ++i) table_.push_back(free_.back()), free_.pop_back();
  put(&table_buf_, table_.data(), table_.size() * 4);
}

void GpuBackend::set_length(int n) {
  SW_CHECK(n >= 0 && n <= capacity(), "length ", n, " beyond the reserved ", capacity());
  length_ = n;
}

void GpuBackend::truncate(int n) {
  length_ = std::min(length_, n);
  const int keep = (n + page_size_ - 1) / page_size_;
  while (int(table_.size()) > keep) free_.push_back(table_.back()), table_.pop_back();
}

Act GpuBackend::kv_rows(int a, int n, bool values) {
  gpu::Buffer& b = values ? kv_[a].tv : kv_[a].tk;
  ensure(&b, sizeof(float) * n * d_.n_kv_heads * d_.head_dim);
  return Act{static_cast<float*>(b.host), &b, 0};
}

void GpuBackend::quantize_kv(const gpu::Buffer& x, int n, int pos0, const gpu::Buffer& q,
                               const gpu::Buffer& s, bool paged) {
  const SwKVQuantParams p{n, d_.n_kv_heads, d_.head_dim, paged ? page_size_ : 0, pos0};
  run("kv_quantize", {buf(x), buf(q), buf(s), buf(paged ? table_buf_ : empty_), val(p)},
      grid(n, d_.n_kv_heads, d_.head_dim));
}

void GpuBackend::gather(const gpu::Arg& src, const gpu::Buffer& idx, int n, int width,
                        const gpu::Arg& dst) {
  const SwEltParams p{n, 0, width, 0};
  run("gather_rows", {src, buf(idx), dst, val(p)},
      grid(uint32_t((size_t(n) * width + 255) / 256), 1, 256));
}

void GpuBackend::plan(const BatchLayout& lay) {
  if (planned_forward_ == forward_) return;  // every layer of a forward reads the same
  const int n = lay.n, hist = lay.prefill ? lay.hist_len - n : lay.hist_len;
  std::vector<int> par(n), ident(n), depth(n), anc(size_t(n) * n);
  for (int i = 0; i < n; ++i) par[i] = lay.prefill ? i - 1 : lay.parents[i], ident[i] = i;
  put(&parents_, par.data(), size_t(n) * 4);
  put(&ident_, ident.data(), size_t(n) * 4);
  if (!kv_.empty()) {
    const int max_sg = std::max(1, dev_->max_threads(dev_->pipeline("tree_attn_partial")) / 32);
    row_len_host_.resize(n);
    SW_CHECK(sw_attn_plan(par.data(), n, hist, d_.n_heads, d_.n_kv_heads, max_sg, depth.data(),
                          anc.data(), row_len_host_.data(), &attn_plan_) == 0, "bad tree");
    put(&anc_, anc.data(), size_t(n) * attn_plan_.stride * 4);
    put(&row_len_, row_len_host_.data(), size_t(n) * 4);
  }
  planned_forward_ = forward_;
}

void GpuBackend::attend(int a, Act q, const BatchLayout& lay, Act out) {
  const int n = lay.n, D = d_.head_dim, Hq = d_.n_heads, Hkv = d_.n_kv_heads;
  // A prefill's rows are a chain from the committed history (they see each other through the
  // tree path, with the same int8 operands the pages will hold); a verify's are its tree.
  const int hist = lay.prefill ? lay.hist_len - n : lay.hist_len;
  plan(lay);
  const SwAttnPlan& plan = attn_plan_;
  KVLayer& L = kv_[a];
  const size_t vals = size_t(n) * Hkv * D;
  ensure(&kt8_, vals), ensure(&vt8_, vals), ensure(&kts_, vals / 8), ensure(&vts_, vals / 8);
  quantize_kv(L.tk, n, 0, kt8_, kts_, false);
  quantize_kv(L.tv, n, 0, vt8_, vts_, false);
  const float scale = 1.0f / std::sqrt(float(D));
  int nr = 0, n_chunks = 0, nsg = 0;
  for (int r0 = 0; r0 < n; r0 += nr) {
    sw_attn_block(plan, row_len_host_.data(), r0, kAttnSplit, &nr, &n_chunks, &nsg);
    ensure(&part_, sizeof(float) * n_chunks * nr * Hq * (D + 2));
    const SwAttnParams p{nr, Hq, Hkv, D, hist, page_size_, kAttnSplit, n_chunks, plan.stride, scale};
    const size_t qo = sizeof(float) * r0 * Hq * D;
    run("tree_attn_partial",
        {gpu::Arg::of(*static_cast<const gpu::Buffer*>(q.buf), q.off * 4 + qo), buf(L.k), buf(L.ks), buf(L.v),
         buf(L.vs), buf(table_buf_.handle ? table_buf_ : empty_), buf(kt8_), buf(kts_), buf(vt8_), buf(vts_),
         buf(anc_, sizeof(int) * r0 * plan.stride), buf(row_len_, sizeof(int) * r0), buf(part_), val(p)},
        grid(n_chunks, Hkv, nsg * 32, {size_t(sw_attn_smem_bytes(D))}));
    run("tree_attn_merge",
        {buf(part_), buf(row_len_, sizeof(int) * r0),
         gpu::Arg::of(*static_cast<const gpu::Buffer*>(out.buf), out.off * 4 + qo), val(p)},
        grid(nr, Hq, 32));
  }
  if (lay.prefill) {  // the rows are committed as they go
    quantize_kv(L.tk, n, hist, L.k, L.ks, true);
    quantize_kv(L.tv, n, hist, L.v, L.vs, true);
  }
}

// ---- GDN ----

void GpuBackend::gdn(int gi, Act qkv, Act decay, Act beta, const BatchLayout& lay, Act out) {
  GDNState& g = gdn_[gi];
  const int n = lay.n, C = d_.conv_dim(), hk = d_.hk, hv = d_.hv, dk = d_.dk, dv = d_.dv;
  plan(lay);
  // the rows' inputs stay for commit's window; qkv is scratch that the next layer reuses
  ensure(&g.x, sizeof(float) * n * C);
  gather(arg(qkv), ident_, n, C, buf(g.x));
  ensure(&gq_, sizeof(float) * n * hk * dk), ensure(&gk_, sizeof(float) * n * hk * dk);
  ensure(&gv_, sizeof(float) * n * hv * dv);
  // a tree keeps every node's state (commit selects the leaf's); a prefill chunk, committed as
  // it goes, only its last one: its rows x Hv x dk x dv floats would dwarf the model's state
  const int slots = lay.prefill ? 1 : n;
  ensure(&g.node_state, sizeof(float) * slots * hv * dk * dv);
  const SwGDNParams p{n, hk, hv, dk, dv, d_.conv_k, d_.tiled ? 0 : 1, 0, 0, 0, 0,
                      1.0f / std::sqrt(float(dk)), lay.prefill ? 1 : 0};
  run("gdn_conv", {buf(g.x), buf(parents_), buf(g.window), buf(shared_->conv_w[gi]), buf(gq_), buf(gk_), buf(gv_), val(p)},
      grid(n, 2 * hk + hv, 32));
  run("gdn_recur",
      {buf(g.S), buf(empty_), buf(empty_), buf(empty_), buf(empty_), buf(gq_), buf(gk_), buf(gv_), arg(decay),
       arg(beta), buf(parents_), arg(out), buf(g.node_state), val(p)},
      grid(hv, 1, round32(std::max(dk, dv)), {sizeof(float) * 2 * dk}));
  if (lay.prefill) gdn_commit_path(g, ident_, n, true);  // the chain is committed: S = its last node's
}

void GpuBackend::gdn_commit_path(GDNState& g, const gpu::Buffer& path, int path_len, bool last_in_slot0) {
  const int hk = d_.hk, hv = d_.hv, dk = d_.dk, dv = d_.dv, C = d_.conv_dim();
  const SwGDNParams p{0, hk, hv, dk, dv, d_.conv_k, d_.tiled ? 0 : 1, 0, path_len, 0, 1, 0.0f};
  // the leaf's state is node_state[path[len - 1]]; a chunk that kept only its last state has
  // it in slot 0, which the identity path names as path[0]
  SwGDNParams select = p;
  select.path_len = last_in_slot0 ? 1 : path_len;
  const gpu::Arg e = buf(empty_);
  run("gdn_commit", {buf(g.S), e, e, e, e, e, e, e, e, buf(path), buf(g.node_state), e, e, e, e, val(select)},
      grid(hv, 1, round32(std::max(dk, dv)), {sizeof(float) * dk}));
  run("gdn_window", {buf(g.window), buf(g.x), buf(path), buf(g.window_next), val(p)},
      grid((C + SW_GDN_THREADS_W - 1) / SW_GDN_THREADS_W, 1, SW_GDN_THREADS_W));
  std::swap(g.window, g.window_next);
}

void GpuBackend::commit(int P, const std::vector<int>& path) {
  const int m = int(path.size()), row = d_.n_kv_heads * d_.head_dim;
  put(&path_, path.data(), size_t(m) * 4);
  for (KVLayer& L : kv_) {
    ensure(&tmp_, sizeof(float) * m * row);
    gather(buf(L.tk), path_, m, row, buf(tmp_));
    quantize_kv(tmp_, m, P, L.k, L.ks, true);
    gather(buf(L.tv), path_, m, row, buf(tmp_));
    quantize_kv(tmp_, m, P, L.v, L.vs, true);
  }
  for (GDNState& g : gdn_) gdn_commit_path(g, path_, m, false);
  length_ = P + m;
  sync();
}

void GpuBackend::save_gdn() {
  sync();
  for (GDNState& g : gdn_) {
    const float* S = static_cast<const float*>(g.S.host);
    const float* w = static_cast<const float*>(g.window.host);
    g.saved_S.assign(S, S + d_.hv * d_.dk * d_.dv);
    g.saved_window.assign(w, w + (d_.conv_k - 1) * d_.conv_dim());
  }
}

void GpuBackend::restore_gdn() {
  sync();
  for (GDNState& g : gdn_) {
    std::memcpy(g.S.host, g.saved_S.data(), g.saved_S.size() * 4);
    std::memcpy(g.window.host, g.saved_window.data(), g.saved_window.size() * 4);
  }
}

void GpuBackend::reset() {
  sync();
  truncate(0);
  for (GDNState& g : gdn_) {
    std::memset(g.S.host, 0, g.S.bytes);
    std::memset(g.window.host, 0, g.window.bytes);
  }
}

// ---- benchmarks, snapshots, sizes ----

void GpuBackend::write_kv(int a, int P, int n, const float* k, const float* v) {
  const size_t bytes = sizeof(float) * n * d_.n_kv_heads * d_.head_dim;
  put(&tmp_, k, bytes);
  quantize_kv(tmp_, n, P, kv_[a].k, kv_[a].ks, true);
  sync();  // tmp_ is written again next
  put(&tmp_, v, bytes);
  quantize_kv(tmp_, n, P, kv_[a].v, kv_[a].vs, true);
  sync();
}

void GpuBackend::snapshot(Snapshot* s) const {
  sync();
  const size_t pv = page_floats(), ps = pv / SW_KV_GROUP * 4;  // int8 values, scale bytes
  const int used = (length_ + page_size_ - 1) / page_size_;
  for (int i = 0; i < used; ++i) {
    std::vector<uint8_t> page;
    for (const KVLayer& L : kv_)
      for (auto [b, size] : {std::pair{&L.k, pv}, {&L.v, pv}, {&L.ks, ps}, {&L.vs, ps}}) {
        const uint8_t* src = static_cast<const uint8_t*>(b->host) + size * table_[i];
        page.insert(page.end(), src, src + size);
      }
    s->pages.push_back(std::move(page));
  }
  for (const GDNState& g : gdn_) {
    const float* S = static_cast<const float*>(g.S.host);
    const float* w = static_cast<const float*>(g.window.host);
    std::vector<float> blob(S, S + d_.hv * d_.dk * d_.dv);
    blob.insert(blob.end(), w, w + (d_.conv_k - 1) * d_.conv_dim());
    s->gdn.push_back(std::move(blob));
  }
}

void GpuBackend::restore(const Snapshot& s) {
  const size_t pv = page_floats(), ps = pv / SW_KV_GROUP * 4;
  const size_t page_bytes = kv_.size() * 2 * (pv + ps);
  const size_t blob = size_t(d_.hv) * d_.dk * d_.dv + size_t(d_.conv_k - 1) * d_.conv_dim();
  SW_CHECK(s.length >= 0 && s.length <= num_pages_ * page_size_, "snapshot of ", s.length,
           " positions does not fit this engine's ", num_pages_ * page_size_);
  SW_CHECK(s.pages.size() == size_t((s.length + page_size_ - 1) / page_size_), "snapshot has ",
           s.pages.size(), " pages for ", s.length, " positions");
  for (const auto& p : s.pages)
    SW_CHECK(p.size() == page_bytes, "snapshot page of ", p.size(), " bytes, this engine's are ", page_bytes);
  SW_CHECK(s.gdn.size() == gdn_.size(), "snapshot has ", s.gdn.size(), " GDN layers, this model ", gdn_.size());
  for (const auto& b : s.gdn) SW_CHECK(b.size() == blob, "snapshot GDN state does not match this model's dims");
  reset();
  reserve(s.length);
  for (size_t i = 0; i < s.pages.size(); ++i) {
    const uint8_t* src = s.pages[i].data();
    for (KVLayer& L : kv_)
      for (auto [b, size] : {std::pair{&L.k, pv}, {&L.v, pv}, {&L.ks, ps}, {&L.vs, ps}}) {
        std::memcpy(static_cast<uint8_t*>(b->host) + size * table_[i], src, size);
        src += size;
      }
  }
  for (size_t l = 0; l < gdn_.size(); ++l) {
    const size_t nS = size_t(d_.hv) * d_.dk * d_.dv;
    std::memcpy(gdn_[l].S.host, s.gdn[l].data(), nS * 4);
    std::memcpy(gdn_[l].window.host, s.gdn[l].data() + nS, (blob - nS) * 4);
  }
  length_ = s.length;
}

size_t GpuBackend::kv_bytes() const {
  return kv_.size() * 2 * size_t(num_pages_) * (page_floats() + page_floats() / SW_KV_GROUP * 4);
}

size_t GpuBackend::kv_bytes_used() const {
  return kv_.size() * 2 * table_.size() * (page_floats() + page_floats() / SW_KV_GROUP * 4);
}

size_t GpuBackend::gdn_state_bytes() const {
  size_t b = 0;
  for (const GDNState& g : gdn_) b += g.S.bytes + g.window.bytes;
  return b;
}

}  // namespace sapwood

// The CPU backend: the ISA-dispatched kernels of csrc/kernels on host memory, the paged KV
// cache (kv_cache.h) and the pathwise GDN layers with their pending tape (gdn_layer.h).
#pragma once
#include <memory>
#include <vector>

#include "backend.h"
#include "gdn_layer.h"
#include "kv_cache.h"

namespace sapwood {

class CpuBackend final : public Backend {
 public:
  CpuBackend(const ModelDims& d, const ModelWeights& w, KVDtype kv, int max_context,
             int page_size, int threads);
  std::string name() const override { return "cpu"; }
  void set_threads(int threads) override { threads_ = threads; }
  // the weights are the engine's (ModelWeights, shared by its siblings): nothing to copy
  std::unique_ptr<Backend> new_sequence(int max_context, int threads) const override {
    return std::make_unique<CpuBackend>(d_, w_, kv_, max_context, page_size_, threads);
  }

  Act scratch(int id, size_t n) override;
  void upload(Act dst, const float* src, size_t n) override;
  void download(Act src, size_t n, float* dst) override;
  void copy(Act dst, Act src, size_t n) override;

  void embed(const QMatrix& table, const int* tokens, int n, Act x) override;
  void rms_norm(Act x, const std::vector<float>& w, int n, int dim, float eps, Act out) override;
  void add(Act x, Act y, size_t n) override;
  void silu_mul(Act x, Act u, Act out, size_t n) override;
  void sigmoid_mul(Act x, Act u, Act out, size_t n) override;
  void split_q_gate(Act qg, int n, int heads, int dim, Act q, Act gate) override;
  void rope(Act x, int n, int heads, int dim, int rot, Act cs) override;
  void gdn_gates(Act ba, int n, int hv, const std::vector<float>& neg_exp_a,
                 const std::vector<float>& dt_bias, Act beta, Act g) override;
  void matmul(Act x, int n, std::initializer_list<std::pair<const QMatrix*, Act>> outs) override;
  void top_k_rows(Act x, int rows, int cols, int k, Act ids, Act vals) override;
  void logsumexp_rows(Act x, int rows, int cols, Act out) override;

  int length() const override { return seq_->length(); }
  int capacity() const override { return seq_->capacity(); }
  void reserve(int n) override { seq_->reserve(n); }
  void set_length(int n) override { seq_->set_length(n); }
  void truncate(int n) override { seq_->truncate(n); }
  Act kv_rows(int a, int n, bool values) override;
  void attend(int a, Act q, const BatchLayout& lay, Act out) override;
  void gdn(int g, Act qkv, Act decay, Act beta, const BatchLayout& lay, Act out) override;
  void commit(int P, const std::vector<int>& path) override;
  void save_gdn() override;
  void restore_gdn() override;
  void fold_pending(int threads) override;
  void reset() override;
  bool keeps_rows() const override { return true; }
  void keep_row(int slot, int row) override;
  void append_kept(const std::vector<int>& slots, int threads) override;
  void write_kv(int a, int P, int n, const float* k, const float* v) override;
  void snapshot(Snapshot* s) const override;
  void restore(const Snapshot& s) override;
  size_t kv_bytes() const override { return pool_->bytes(); }
  size_t kv_bytes_used() const override {
    return seq_->page_table().size() * pool_->page_bytes();
  }
  size_t gdn_state_bytes() const override;

  std::vector<GDNLayer>& gdn_layers() { return gdn_; }

 private:
  const ModelDims& d_;
  const ModelWeights& w_;
  KVDtype kv_;
  int page_size_, threads_;
  std::shared_ptr<KVPagePool> pool_;
  std::unique_ptr<KVSequence> seq_;
  std::vector<GDNLayer> gdn_;
  struct KVTape {  // per attention layer, the K/V of the rows of the last forward, f32 [n][Hkv][D]
    std::vector<float> k, v;
  };
  std::vector<KVTape> tape_;
  std::vector<GDNLayer::Committed> saved_gdn_;      // save_gdn()
  std::vector<std::vector<GDNLayer::Token>> kept_;  // [slot][layer], buffers reused
  std::vector<std::vector<float>> bufs_;
  std::vector<float> kt_, vt_;  // the tree rows' keys and values as the cache will hold them
  std::vector<int8_t> kq_;      // the tree rows' keys in int8 (int8 pools), as pages hold them
  std::vector<float> ks_;
  QActs acts_;
};

}  // namespace sapwood

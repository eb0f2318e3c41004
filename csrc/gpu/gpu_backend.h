// The Metal backend: the op list and the sequence state of backend.h as metal/*.metal kernels
// dispatched through a gpu::Device, the real one on macOS or the emulator (emu/) anywhere. All
// of it (weight layouts, KV pages, GDN state, planning, argument binding, op order) is shared
// by both devices, so CI runs the code a Mac runs, on the emulated device.
//
// State, all resident in device buffers: per attention layer int8 K/V pages
// [pages][Hkv][page_size][D] with fp32 scales per 32 dims, and this forward's fp32 K/V rows (the
// commit's tape); per GDN layer the state S [hv][dk][dv], the conv window [K-1][C], the rows'
// pre-conv inputs and every tree node's state (commit selects the leaf's, so nothing stays
// pending; a prefill chunk keeps only its last state).
//
// Siblings (new_sequence) share the device, its one queue and the weights uploaded to it; each
// has its own state and scratch. A forest forward's dispatches, whichever sibling encodes them,
// go to the one queue in program order; engine calls over siblings take device_lock().
#pragma once
#include <map>
#include <memory>
#include <mutex>

#include "../../metal/sw_plan.h"
#include "../backend.h"
#include "device.h"

namespace sapwood {

class GpuBackend final : public Backend {
 public:
  GpuBackend(std::unique_ptr<gpu::Device> dev, const ModelDims& d, const ModelWeights& w,
               KVDtype kv, int max_context, int page_size);
  ~GpuBackend() override;
  std::string name() const override { return name_; }
  void set_threads(int) override {}
  std::unique_ptr<Backend> new_sequence(int max_context, int threads) const override;
  std::recursive_mutex* device_lock() const override { return &shared_->lock; }
  void begin_forward() override { ++forward_; }

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
  int64_t syncs() const override { return syncs_; }

  int length() const override { return length_; }
  int capacity() const override { return int(table_.size()) * page_size_; }
  void reserve(int n) override;
  void set_length(int n) override;
  void truncate(int n) override;
  Act kv_rows(int a, int n, bool values) override;
  void attend(int a, Act q, const BatchLayout& lay, Act out) override;
  void gdn(int g, Act qkv, Act decay, Act beta, const BatchLayout& lay, Act out) override;
  void commit(int P, const std::vector<int>& path) override;
  void save_gdn() override;
  void restore_gdn() override;
  void fold_pending(int) override {}  // commit selects the leaf's state: nothing is pending
  void reset() override;
  bool keeps_rows() const override { return false; }
  void keep_row(int, int) override {}
  void append_kept(const std::vector<int>&, int) override {}
  void write_kv(int a, int P, int n, const float* k, const float* v) override;
  void add_weights(const std::vector<const QMatrix*>& mats,
                   const std::vector<const std::vector<float>*>& vecs) override;
  void snapshot(Snapshot* s) const override;
  void restore(const Snapshot& s) override;
  size_t kv_bytes() const override;
  size_t kv_bytes_used() const override;
  size_t gdn_state_bytes() const override;

 private:
  struct Mat {  // a weight matrix in the kernels' row-major layout
    WFormat fmt;
    int rows, cols, cols_pad;
    gpu::Buffer w, scale;
    gpu::Buffer bias;             // q4 affine: [rows][groups]; else unallocated
    int group = kQ4Group;         // q4: inputs a scale (64, or 32 affine)
    bool affine = false;
    const gpu::Buffer& bias_or_scale() const { return affine ? bias : scale; }  // symmetric: unread
  };
  struct KVLayer {
    gpu::Buffer k, v, ks, vs;  // pages
    gpu::Buffer tk, tv;        // this forward's rows, fp32 [n][Hkv][D]
  };
  struct GDNState {
    gpu::Buffer S, window, window_next, x, node_state;
    std::vector<float> saved_S, saved_window;  // save_gdn()
  };

  // What siblings share: the device (its queue), the weights uploaded to it, and the lock.
  struct Shared {
    explicit Shared(std::unique_ptr<gpu::Device> d) : dev(std::move(d)) {}
    ~Shared();
    std::unique_ptr<gpu::Device> dev;
    std::map<const void*, Mat> mats;
    std::map<const void*, gpu::Buffer> vecs;
    std::vector<gpu::Buffer> conv_w;  // per GDN layer, the kernel's [K][C]
    std::recursive_mutex lock;
    bool pending = false;  // dispatched since the queue's last wait (by any sibling)
  };
  // a sequence's own state over `shared` (a first sequence then uploads the weights to it)
  GpuBackend(std::shared_ptr<Shared> shared, const ModelDims& d, const ModelWeights& w,
             KVDtype kv, int max_context, int page_size);
  void upload_weights();  // the model's weights to the shared device, once for all siblings

  gpu::Buffer alloc(size_t bytes);
  // buffer *b with room for `bytes` (reallocated, contents dropped, when smaller)
  void ensure(gpu::Buffer* b, size_t bytes);
  void put(gpu::Buffer* b, const void* src, size_t bytes);  // host data into a device buffer
  void sync() const;
  void run(const char* kernel, const std::vector<gpu::Arg>& args, gpu::Launch l);
  static gpu::Arg arg(Act a);
  const Mat& mat(const QMatrix* m) const;
  const gpu::Buffer& vec(const std::vector<float>& v) const;
  void upload_matrix(const QMatrix& m);
  void upload_vec(const std::vector<float>& v);
  // the rows [0, n) of src ([*][width] floats) at positions idx into dst
  void gather(const gpu::Arg& src, const gpu::Buffer& idx, int n, int width, const gpu::Arg& dst);
  void quantize_kv(const gpu::Buffer& x, int n, int pos0, const gpu::Buffer& q, const gpu::Buffer& s,
                   bool paged);
  // this forward's parents, identity, ancestor table and row lengths, once a forward
  void plan(const BatchLayout& lay);
  // S = the leaf's state, the conv window moved along `path` (the identity path of a prefill
  // chunk, whose recur kept only its last state in slot 0: last_in_slot0)
  void gdn_commit_path(GDNState& g, const gpu::Buffer& path, int path_len, bool last_in_slot0);
  size_t page_floats() const;  // K (or V) values of one page of one layer

  std::shared_ptr<Shared> shared_;
  gpu::Device* dev_;  // shared_'s
  std::string name_;
  const ModelDims& d_;
  const ModelWeights& w_;
  KVDtype kv_dtype_;
  int page_size_, num_pages_;
  std::vector<gpu::Buffer> scratch_;
  std::vector<KVLayer> kv_;
  std::vector<GDNState> gdn_;
  // per-forward inputs from the host, each written once before the dispatches that read it
  gpu::Buffer tokens_, parents_, anc_, row_len_, path_, ident_, table_buf_, xq_, xs_, part_;
  gpu::Buffer kt8_, kts_, vt8_, vts_, gq_, gk_, gv_, tmp_, empty_, skip_;
  mutable int64_t syncs_ = 0;  // waits for work this backend's queue had pending
  long forward_ = 0, planned_forward_ = -1;
  SwAttnPlan attn_plan_{};            // this forward's tree-attention plan and rows' lengths
  std::vector<int> row_len_host_;
  std::vector<int> table_, free_;  // page table, free pages
  int length_ = 0;
};

}  // namespace sapwood

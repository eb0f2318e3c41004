// The backend seam (docs/design.md "Backends"): one op list that the forward, the commit and the
// drafter need, and the state of one sequence (KV pages, GDN state, tape, conv window) that a
// backend owns in its own memory and layout. The forward (model.cpp) and the engine
// (engine.cpp) are written once over it; the CPU backend is the ISA-dispatched kernels of
// csrc/kernels, the Metal and SYCL backends dispatch their kernels through gpu::Device.
//
// Exactness holds within a backend (a node's result depends on its path only, bitwise);
// across backends results agree within the tolerances the cross-backend tests state.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "model.h"

namespace sapwood {

// A view of floats in a backend's memory. `p` is host-visible (the CPU's own memory, or the
// shared memory of a GPU buffer: read only after a sync point); `buf`/`off` name the same place
// for a device (null on the CPU).
struct Act {
  float* p = nullptr;
  const void* buf = nullptr;
  size_t off = 0;  // in floats
  Act operator+(size_t n) const { return Act{p + n, buf, off + n}; }
};

// What a snapshot holds: the committed state only (no weights), in the backend's layout,
// with the identity of the engine's model and backend so a foreign one is refused.
struct Snapshot {
  int length = 0;
  std::string backend;
  uint64_t model_id = 0;
  std::vector<std::vector<uint8_t>> pages;  // KV page contents, in page-table order
  std::vector<std::vector<float>> gdn;      // per GDN layer, the backend's committed-state blob
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual void set_threads(int threads) = 0;  // threads of the next forward (CPU)

  // ---- sequences of one model (Engine::new_sequence) ----
  // A backend for another sequence of the same model: this one's weights (on a GPU, its
  // device and the weights uploaded to it) shared, its own empty state of max_context
  // positions. Siblings' rows can run in one forward (Forward::run_forest).
  virtual std::unique_ptr<Backend> new_sequence(int max_context, int threads) const = 0;
  // Siblings that share one device queue (a GPU's) must not encode from two threads at once:
  // the lock every engine call over this backend holds. Null where siblings share nothing
  // mutable (the CPU's).
  virtual std::recursive_mutex* device_lock() const { return nullptr; }
  // A forward over this sequence's state begins (Forward calls it on every sequence of the
  // forward before the first layer): the layouts attend() and gdn() are handed from now on are
  // the new forward's, so a backend may plan what all its layers share (the tree) once.
  virtual void begin_forward() {}

  // ---- activations ----
  // Scratch buffer `id` (Forward::Buf) with room for n floats, kept across forwards.
  virtual Act scratch(int id, size_t n) = 0;
  // Host data into device memory before the forward's dispatches read it (shared memory: a
  // copy; the CPU: a copy too, so callers never alias their own vectors).
  virtual void upload(Act dst, const float* src, size_t n) = 0;
  // Wait for the forward and copy n floats out (the sync point).
  virtual void download(Act src, size_t n, float* dst) = 0;
  // dst = src, n floats in device order (the two do not overlap): a forest's K/V rows into
  // each sequence's own rows.
  virtual void copy(Act dst, Act src, size_t n) = 0;

  // ---- stateless ops (rows-major fp32; out may alias an input where noted) ----
  // x[i] = row tokens[i] of the embedding table, as the matmul sees it
  virtual void embed(const QMatrix& table, const int* tokens, int n, Act x) = 0;
  // n rows of dim: (x * rsqrt(mean(x^2) + eps)) * w; out may alias x
  virtual void rms_norm(Act x, const std::vector<float>& w, int n, int dim, float eps, Act out) = 0;
  virtual void add(Act x, Act y, size_t n) = 0;                       // x += y
  virtual void silu_mul(Act x, Act u, Act out, size_t n) = 0;         // silu(x) * u; aliasing ok
  virtual void sigmoid_mul(Act x, Act u, Act out, size_t n) = 0;      // sigmoid(x) * u
  // [n][heads][2 dim] (per head q | gate) -> q, gate [n][heads][dim]
  virtual void split_q_gate(Act qg, int n, int heads, int dim, Act q, Act gate) = 0;
  // rotate-half on the first rot dims of each head, in place; cs [n][rot/2][(cos, sin)]
  virtual void rope(Act x, int n, int heads, int dim, int rot, Act cs) = 0;
  // ba [n][2 hv] (b | a) -> beta = sigmoid(b), g = neg_exp_a * softplus(a + dt_bias)
  virtual void gdn_gates(Act ba, int n, int hv, const std::vector<float>& neg_exp_a,
                         const std::vector<float>& dt_bias, Act beta, Act g) = 0;
  // y = x W^T for each (W, y) reading the same x of n rows (1..kMaxMatmuls matrices)
  virtual void matmul(Act x, int n, std::initializer_list<std::pair<const QMatrix*, Act>> outs) = 0;

  // ---- drafting over rows of logits, in the backend's memory ----
  // A greedy draft row's pick and candidates: only 2k + 1 values leave the device, not the
  // vocabulary's logits (the host then does nothing of the vocabulary's size).
  // The k (<= kMaxTopK) best ids of each row, best first, an equal value's lower id first, NaN
  // never (-1 where fewer qualify), and their values: ids (int32 bits) and vals, [rows][k].
  static constexpr int kMaxTopK = 16;
  virtual void top_k_rows(Act x, int rows, int cols, int k, Act ids, Act vals) = 0;
  // out[r] = max + log(sum exp(x[r] - max))
  virtual void logsumexp_rows(Act x, int rows, int cols, Act out) = 0;
  // How often the host has waited for the device so far (a GPU's sync points; none on the
  // CPU, whose ops are done when they return).
  virtual int64_t syncs() const { return 0; }

  // ---- the sequence's state ----
  virtual int length() const = 0;
  virtual int capacity() const = 0;
  virtual void reserve(int n) = 0;     // room for positions < n; on failure nothing changes
  virtual void set_length(int n) = 0;  // n <= capacity
  virtual void truncate(int n) = 0;    // drop positions >= n

  // Attention layer `a`: the rows' keys and values [n][Hkv][D] (after norm and rotary) go to
  // kv_rows(a, n) first; attend() then writes them to pages (prefill: the rows are committed as
  // they go) or keeps them as this forward's tape (verify), and attends.
  virtual Act kv_rows(int a, int n, bool values) = 0;
  virtual void attend(int a, Act q, const BatchLayout& lay, Act out) = 0;
  // GDN layer g: qkv [n][C] pre-conv inputs -> out [n][hv][dv] (prefill commits the chain).
  virtual void gdn(int g, Act qkv, Act decay, Act beta, const BatchLayout& lay, Act out) = 0;

  // Commit `path` of the last verify at positions [P, P + path): its KV rows, the GDN state at
  // the leaf and the conv window along it. reserve(P + path) has succeeded.
  virtual void commit(int P, const std::vector<int>& path) = 0;
  // The GDN layers' committed state saved and brought back (a failed prefill, a draft chain).
  virtual void save_gdn() = 0;
  virtual void restore_gdn() = 0;
  virtual void fold_pending(int threads) = 0;  // fold committed-but-unfolded GDN tokens
  virtual void reset() = 0;

  // Draft-row keeping (Engine::keep_draft): after a prefill forward, remember the GDN token of
  // its row `row` in slot `slot`; append_kept commits slots as pending tokens. A backend that
  // does not keep rows returns false from keeps_rows() and the engine re-prefills instead.
  virtual bool keeps_rows() const = 0;
  virtual void keep_row(int slot, int row) = 0;
  virtual void append_kept(const std::vector<int>& slots, int threads) = 0;

  // Attention layer a's keys and values [n][Hkv][D] at positions [P, P + n), reserved
  // (Engine::fill_synthetic's benchmark contexts).
  virtual void write_kv(int a, int P, int n, const float* k, const float* v) = 0;
  virtual void snapshot(Snapshot* s) const = 0;
  virtual void restore(const Snapshot& s) = 0;  // validated by the engine first

  virtual size_t kv_bytes() const = 0;
  virtual size_t kv_bytes_used() const = 0;
  virtual size_t gdn_state_bytes() const = 0;

  // Weights kept alive by the caller that forwards over this backend read beside the model's
  // (the MTP head: its fc halves and input norms, the target's embedding table and LM head). A
  // device backend copies them into its own buffers; the CPU reads them where they lie.
  virtual void add_weights(const std::vector<const QMatrix*>& mats,
                           const std::vector<const std::vector<float>*>& vecs) {
    (void)mats, (void)vecs;
  }
};

// The backends this build has: "cpu" always, then "metal", "metal-emulated", "sycl",
// "sycl-emulated" as built.
std::vector<std::string> available_backends();
// A backend for the model `w` (kept alive by the caller) with room for max_context positions.
// Throws naming what to install or rebuild when `name` is not in this build.
std::unique_ptr<Backend> make_backend(const std::string& name, const ModelDims& d,
                                      const ModelWeights& w, KVDtype kv, int max_context,
                                      int page_size, int threads);

}  // namespace sapwood

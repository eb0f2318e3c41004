// Paged KV cache: a pool of fixed-size pages and per-sequence page tables.
//
// A page holds `page_size` consecutive positions for every layer and KV head, laid out
// [layer][kv_head][slot][dim] so one head's keys in a page are contiguous. Int8 storage keeps
// one fp32 scale per 32 dims (docs/design.md "Int8 KV pages"); f32 storage exists for parity tests.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "huge_pages.h"

namespace sapwood {

enum class KVDtype { Int8, F32 };
constexpr int kKVGroup = 32;

// x[D] -> q[D], scale[D/32]: scale = amax/127, q = clamp(rint(x/scale), -127, 127).
void quantize_int8(const float* x, int dim, int8_t* q, float* scale);
void dequantize_int8(const int8_t* q, const float* scale, int dim, float* out);
// What a query sees of a key or value: x -> dequantize(quantize(x)), or x itself for f32.
void kv_roundtrip(const float* x, int dim, KVDtype dtype, float* out);
// quantize_int8 of `rows` rows of dim into *q [rows][dim] and *scale [rows][dim / 32] (resized).
void quantize_tree_keys(const float* x, size_t rows, int dim, std::vector<int8_t>* q,
                        std::vector<float>* scale);

class KVPagePool {
 public:
  KVPagePool(int num_pages, int page_size, int n_layers, int n_kv_heads, int head_dim,
             KVDtype dtype);
  ~KVPagePool();
  KVPagePool(const KVPagePool&) = delete;
  KVPagePool& operator=(const KVPagePool&) = delete;
  int num_pages() const { return num_pages_; }
  int page_size() const { return page_size_; }
  int n_layers() const { return n_layers_; }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  KVDtype dtype() const { return dtype_; }
  int free_pages() const { return int(free_.size()); }
  size_t bytes() const { return bytes_; }  // reserved; resident only once written
  size_t page_bytes() const { return page_bytes_; }
  uint8_t* page_data(int page) { return data_ + page_bytes_ * page; }
  const uint8_t* page_data(int page) const { return data_ + page_bytes_ * page; }

  int alloc();           // throws CapacityError when empty
  void release(int page);

  // Start of [slot][dim] for (page, layer, head). Int8: int8 data and [slot][dim/32] scales.
  int8_t* k_int8(int page, int layer, int head) { return (int8_t*)raw(page, layer, head, 0); }
  int8_t* v_int8(int page, int layer, int head) { return (int8_t*)raw(page, layer, head, 1); }
  float* k_scale(int page, int layer, int head) { return (float*)raw(page, layer, head, 2); }
  float* v_scale(int page, int layer, int head) { return (float*)raw(page, layer, head, 3); }
  float* k_f32(int page, int layer, int head) { return (float*)raw(page, layer, head, 0); }
  float* v_f32(int page, int layer, int head) { return (float*)raw(page, layer, head, 1); }

  // Write one token's k, v [n_kv_heads][head_dim] at (page, slot) of a layer.
  void write(int page, int slot, int layer, const float* k, const float* v);
  // Dequantized k, v of positions [slot0, slot0+count) of one head into [count][head_dim].
  void read(int page, int slot0, int count, int layer, int head, float* k, float* v) const;

 private:
  uint8_t* raw(int page, int layer, int head, int which) const;
  int num_pages_, page_size_, n_layers_, n_kv_heads_, head_dim_;
  KVDtype dtype_;
  size_t part_bytes_[4];   // bytes of one [slot][..] block for k, v, k_scale, v_scale
  size_t head_bytes_, page_bytes_;
  size_t bytes_ = 0;
  uint8_t* data_ = nullptr;  // alloc_lazy_zeroed: a page takes memory when first written
  std::vector<int> free_;
};

// One sequence's positions in the pool. Positions [0, length) are committed.
class KVSequence {
 public:
  explicit KVSequence(std::shared_ptr<KVPagePool> pool);
  ~KVSequence();
  KVSequence(const KVSequence&) = delete;
  KVSequence& operator=(const KVSequence&) = delete;

  KVPagePool& pool() const { return *pool_; }
  const std::shared_ptr<KVPagePool>& pool_ptr() const { return pool_; }
  int length() const { return length_; }
  int capacity() const { return int(pages_.size()) * pool_->page_size(); }
  const std::vector<int>& page_table() const { return pages_; }

  // Make room for positions up to new_length (allocating pages); on failure nothing changes.
  void reserve(int new_length);
  // Write token `pos` (< capacity) of `layer`; does not move length.
  void write(int pos, int layer, const float* k, const float* v);
  void set_length(int n);   // n <= capacity
  void truncate(int n);     // drop positions >= n and free whole pages past them

 private:
  std::shared_ptr<KVPagePool> pool_;
  std::vector<int> pages_;
  int length_ = 0;
};

}  // namespace sapwood

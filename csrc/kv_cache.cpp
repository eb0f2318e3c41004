#include "kv_cache.h"

#include <cmath>
#include <cstring>

#include "common.h"

namespace sapwood {

void quantize_int8(const float* x, int dim, int8_t* q, float* scale) {
  for (int g = 0; g < dim / kKVGroup; ++g)
    scale[g] = quantize_block(x + g * kKVGroup, kKVGroup, 127.0f, q + g * kKVGroup);
}

void dequantize_int8(const int8_t* q, const float* scale, int dim, float* out) {
  for (int j = 0; j < dim; ++j) out[j] = float(q[j]) * scale[j / kKVGroup];
}

void kv_roundtrip(const float* x, int dim, KVDtype dtype, float* out) {
  if (dtype == KVDtype::F32) {
    std::memcpy(out, x, sizeof(float) * dim);
    return;
  }
  int8_t q[1024];
  float s[1024 / kKVGroup];
  quantize_int8(x, dim, q, s);
  dequantize_int8(q, s, dim, out);
}

void quantize_tree_keys(const float* x, size_t rows, int dim, std::vector<int8_t>* q,
                        std::vector<float>* scale) {
  q->resize(rows * dim);
  scale->resize(rows * (dim / kKVGroup));
  for (size_t r = 0; r < rows; ++r)
    quantize_int8(x + r * dim, dim, q->data() + r * dim, scale->data() + r * (dim / kKVGroup));
}

KVPagePool::KVPagePool(int num_pages, int page_size, int n_layers, int n_kv_heads, int head_dim,
                       KVDtype dtype)
    : num_pages_(num_pages), page_size_(page_size), n_layers_(n_layers),
      n_kv_heads_(n_kv_heads), head_dim_(head_dim), dtype_(dtype) {
  SW_CHECK(num_pages > 0, "num_pages must be positive, got ", num_pages);
  SW_CHECK(page_size > 0 && page_size % 32 == 0, "page_size must be a positive multiple of 32, got ",
           page_size);
  SW_CHECK(n_layers > 0 && n_kv_heads > 0, "n_layers and n_kv_heads must be positive");
  SW_CHECK(head_dim > 0 && head_dim % kKVGroup == 0 && head_dim <= 1024,
           "head_dim must be a multiple of 32 up to 1024, got ", head_dim);
  if (dtype == KVDtype::Int8) {
    part_bytes_[0] = part_bytes_[1] = size_t(page_size) * head_dim;
    part_bytes_[2] = part_bytes_[3] = size_t(page_size) * (head_dim / kKVGroup) * sizeof(float);
  } else {
    part_bytes_[0] = part_bytes_[1] = size_t(page_size) * head_dim * sizeof(float);
    part_bytes_[2] = part_bytes_[3] = 0;
  }
  head_bytes_ = part_bytes_[0] + part_bytes_[1] + part_bytes_[2] + part_bytes_[3];
  page_bytes_ = head_bytes_ * n_kv_heads * n_layers;
  bytes_ = page_bytes_ * size_t(num_pages);
  data_ = static_cast<uint8_t*>(alloc_lazy_zeroed(bytes_));
  for (int p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

KVPagePool::~KVPagePool() { free_lazy_zeroed(data_, bytes_); }

uint8_t* KVPagePool::raw(int page, int layer, int head, int which) const {
  size_t off = page_bytes_ * page + head_bytes_ * (size_t(layer) * n_kv_heads_ + head);
  for (int w = 0; w < which; ++w) off += part_bytes_[w];
  return data_ + off;
}

int KVPagePool::alloc() {
  if (free_.empty())
    throw CapacityError(cat("KV page pool exhausted (", num_pages_, " pages of ", page_size_,
                            " positions)"));
  int p = free_.back();
  free_.pop_back();
  return p;
}

void KVPagePool::release(int page) { free_.push_back(page); }

void KVPagePool::write(int page, int slot, int layer, const float* k, const float* v) {
  const int D = head_dim_;
  for (int h = 0; h < n_kv_heads_; ++h) {
    if (dtype_ == KVDtype::Int8) {
      quantize_int8(k + h * D, D, k_int8(page, layer, h) + slot * D,
                    k_scale(page, layer, h) + slot * (D / kKVGroup));
      quantize_int8(v + h * D, D, v_int8(page, layer, h) + slot * D,
                    v_scale(page, layer, h) + slot * (D / kKVGroup));
    } else {
      std::memcpy(k_f32(page, layer, h) + slot * D, k + h * D, sizeof(float) * D);
      std::memcpy(v_f32(page, layer, h) + slot * D, v + h * D, sizeof(float) * D);
    }
  }
}

void KVPagePool::read(int page, int slot0, int count, int layer, int head, float* k,
                      float* v) const {
  auto* self = const_cast<KVPagePool*>(this);
  const int D = head_dim_, G = D / kKVGroup;
  for (int s = 0; s < count; ++s) {
    int slot = slot0 + s;
    if (dtype_ == KVDtype::Int8) {
      dequantize_int8(self->k_int8(page, layer, head) + slot * D,
                      self->k_scale(page, layer, head) + slot * G, D, k + s * D);
      dequantize_int8(self->v_int8(page, layer, head) + slot * D,
                      self->v_scale(page, layer, head) + slot * G, D, v + s * D);
    } else {
      std::memcpy(k + s * D, self->k_f32(page, layer, head) + slot * D, sizeof(float) * D);
      std::memcpy(v + s * D, self->v_f32(page, layer, head) + slot * D, sizeof(float) * D);
    }
  }
}

KVSequence::KVSequence(std::shared_ptr<KVPagePool> pool) : pool_(std::move(pool)) {}

KVSequence::~KVSequence() {
  for (int p : pages_) pool_->release(p);
}

void KVSequence::reserve(int new_length) {
  SW_CHECK(new_length >= 0, "negative length ", new_length);
  const int need = (new_length + pool_->page_size() - 1) / pool_->page_size();
  if (need - int(pages_.size()) > pool_->free_pages())
    throw CapacityError(cat("KV page pool exhausted: positions up to ", new_length, " need ",
                            need, " pages, ", pages_.size() + pool_->free_pages(), " available"));
  while (int(pages_.size()) < need) pages_.push_back(pool_->alloc());
}

void KVSequence::write(int pos, int layer, const float* k, const float* v) {
  SW_CHECK(pos >= 0 && pos < capacity(), "position ", pos, " outside reserved capacity ",
           capacity());
  SW_CHECK(layer >= 0 && layer < pool_->n_layers(), "layer ", layer, " out of range");
  pool_->write(pages_[pos / pool_->page_size()], pos % pool_->page_size(), layer, k, v);
}

void KVSequence::set_length(int n) {
  SW_CHECK(n >= 0 && n <= capacity(), "length ", n, " outside capacity ", capacity());
  length_ = n;
}

void KVSequence::truncate(int n) {
  SW_CHECK(n >= 0 && n <= length_, "cannot truncate to ", n, " (length ", length_, ")");
  length_ = n;
  const int keep = (n + pool_->page_size() - 1) / pool_->page_size();
  while (int(pages_.size()) > keep) {
    pool_->release(pages_.back());
    pages_.pop_back();
  }
}

}  // namespace sapwood

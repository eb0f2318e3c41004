// Where a load reads its tensors, and the loader that turns them into the engine's storage.
//
// A checkpoint is streamed: the loader asks its TensorSource for a bounded chunk of rows at a
// time, in the file's own dtype (f32, f16 or bf16), and the worker threads widen each row,
// check it, fold it into the model's fingerprint and store it in its final format (q8/q4
// quantized on the fly). A load therefore holds the engine plus one chunk, never a whole
// tensor widened to float32; the Python loader (loading.py) serves chunks read from the
// safetensors shards. MapSource serves float32 tensors already in memory (tests, small heads).
#pragma once
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "weights.h"

namespace sapwood {

enum class SrcDtype { F32, F16, BF16 };
size_t src_dtype_size(SrcDtype t);

// 64-bit FNV-1a over small values, four independent multiply lanes over row data (one
// multiply per 8 bytes per lane keeps the extra pass cheap next to the conversions).
struct WeightHasher {
  uint64_t h = 0xcbf29ce484222325ull;
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  }
  template <class T>
  void value(const T& v) { bytes(&v, sizeof v); }
  void data(const float* p, size_t n) {
    uint64_t lane[4] = {1, 2, 3, 4};
    const size_t words = n / 2;  // two floats a word
    size_t i = 0;
    for (; i + 4 <= words; i += 4)
      for (int j = 0; j < 4; ++j) {
        uint64_t w;
        std::memcpy(&w, p + 2 * (i + j), 8);
        lane[j] = (lane[j] ^ w) * 0x9E3779B97F4A7C15ull;
        lane[j] ^= lane[j] >> 29;
      }
    for (uint64_t l : lane) value(l);
    bytes(p + 2 * i, (n - 2 * i) * sizeof(float));
  }
};

class TensorSource {
 public:
  virtual ~TensorSource() = default;
  // The tensor's shape; false when the source has no such tensor.
  virtual bool shape(const std::string& name, std::vector<int64_t>* shape) const = 0;
  // Rows [r0, r1) of the tensor seen as [shape[0]][the rest], row-major in *dtype; the
  // pointer stays valid until the next call.
  virtual const void* rows(const std::string& name, int64_t r0, int64_t r1, SrcDtype* dtype) = 0;
  // How much of a tensor the loader asks for at once.
  virtual size_t chunk_bytes() const { return size_t(32) << 20; }
  // Matrices a pre-quantized checkpoint stores as affine 4-bit groups (MLX's, GGUF's, GPTQ's,
  // repacked): a quantized load keeps them as stored (QMatrix::affine). The group size (32
  // or 64; 0: not stored so); rows [r0, r1) as nibbles [n][cols / 2] (Q4's byte order for
  // that group size) and scales and biases [n][cols / group], valid until the next call;
  // rows() still serves their values as floats.
  virtual int q4_affine_group(const std::string&) const { return 0; }
  virtual void q4_affine_rows(const std::string& name, int64_t r0, int64_t r1,
                              const uint8_t** nibbles, const float** scales, const float** biases) {
    (void)name, (void)r0, (void)r1, (void)nibbles, (void)scales, (void)biases;
  }
};

// A named float32 tensor in memory (Python arrays already checked by the bindings).
struct Tensor {
  const float* data;
  std::vector<int64_t> shape;
};
using TensorMap = std::map<std::string, Tensor>;

class MapSource : public TensorSource {
 public:
  explicit MapSource(const TensorMap& t) : t_(t) {}
  bool shape(const std::string& name, std::vector<int64_t>* shape) const override;
  const void* rows(const std::string& name, int64_t r0, int64_t r1, SrcDtype* dtype) override;

 private:
  const TensorMap& t_;
};

class WeightLoader {
 public:
  WeightLoader(TensorSource& src, int threads) : src_(src), threads_(threads) {}
  // A [rows, cols] matrix in format f.
  QMatrix matrix(const std::string& name, int rows, int cols, WFormat f);
  // The whole tensor as floats (norms, conv taps, gates: small).
  std::vector<float> vector(const std::string& name, const std::vector<int64_t>& shape);
  // Streams the [rows, cols] tensor: fn(r0, n, x) with rows [r0, r0 + n) as n * cols floats,
  // on the worker threads, each row once, blocks in any order. Blocks are kBlockRows rows
  // starting at multiples of kBlockRows (the last one shorter): a group of output channels
  // that Q8/F32/BF16 interleave is stored by one thread in one go. A non-finite value throws
  // naming the tensor. Every streamed tensor enters the fingerprint.
  static constexpr int kBlockRows = 16;
  template <class F>
  void each_block(const std::string& name, int64_t rows, int64_t cols, F&& fn);
  // each_block one row at a time: fn(r, x).
  template <class F>
  void each_row(const std::string& name, int64_t rows, int64_t cols, F&& fn) {
    each_block(name, rows, cols, [&](int64_t r0, int n, const float* x) {
      for (int i = 0; i < n; ++i) fn(r0 + i, x + size_t(i) * size_t(cols));
    });
  }
  // A hash of every tensor read (names, shapes, values as float32), whatever the read order,
  // the source's dtype for equal values, the chunking or the thread count.
  uint64_t fingerprint() const;
  // Throws naming the tensor when it is missing or its shape is not `want`.
  void check_shape(const std::string& name, const std::vector<int64_t>& want) const;

 private:
  using BlockFn = void (*)(void*, int64_t, int, const float*);
  void stream(const std::string& name, int64_t rows, int64_t cols, BlockFn fn, void* obj);
  void stream_q4_affine(const std::string& name, QMatrix* m);

  TensorSource& src_;
  int threads_;
  std::map<std::string, uint64_t> hashes_;
};

template <class F>
void WeightLoader::each_block(const std::string& name, int64_t rows, int64_t cols, F&& fn) {
  stream(name, rows, cols,
         [](void* o, int64_t r0, int n, const float* x) {
           (*static_cast<std::remove_reference_t<F>*>(o))(r0, n, x);
         },
         const_cast<void*>(static_cast<const void*>(&fn)));
}

}  // namespace sapwood

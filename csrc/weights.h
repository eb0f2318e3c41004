// Weight matrices in the formats chosen at load time, and row-wise activation quantization.
//
// Formats (y = x W^T, W [rows = outputs][cols = inputs]):
//   F32  : fp32, packed [rows/16][cols][16] so 16 outputs accumulate side by side.
//   BF16 : the same layout in bfloat16 (round to nearest even from fp32).
//   Q8   : int8 per output channel, scale = amax/127 per row of W; groups of 16 outputs, each
//          one contiguous run of "quads": input quad q (inputs 4q..4q+3) of the group's 16
//          outputs in 64 bytes, [rows16/16][cols32/4][16][4]. This is the B operand layout of
//          AMX (a 64-input block of a group is one 16x64 tile, 1 KB) and of vpdpbusd with a
//          broadcast quad of activations: every SIMD lane accumulates one output, so no path
//          needs horizontal sums, and a decode row streams each group sequentially.
//   Q4   : 4-bit in groups of 64 inputs (or 32), stored as Q8 stores bytes: groups of 16
//          outputs, each a contiguous run of 512-byte blocks, one per 64 inputs. In block s,
//          slot t (0..7) is 64 bytes: byte 4 (o % 16) + i holds input 64s + 4t + i in its low
//          nibble and 64s + 32 + 4t + i in its high one, [rows16/16][cols64/64][8][16][4]. So a
//          64-byte vector of nibbles multiplies one broadcast activation quad into 16 output
//          lanes (vpdpbusd, maddubs), as Q8's quads do, and a decode row streams each group of
//          16 outputs in order. Symmetric (the engine's own): scale = amax/7 per group of 64,
//          q in [-7, 7] stored + 8. Affine (a pre-quantized checkpoint's groups, run as stored:
//          `bias` not empty): the nibble is q in [0, 15] itself and the weight scale * q + bias;
//          groups of 32 (`group` 32: GGUF's Q4_0 / Q4_1 / Q4_K, MLX's groups of 32) are a
//          block's low nibbles (group 2s) and its high ones (2s + 1). Scales (and biases)
//          [rows16/16][groups][16]: one 16-lane vector per (group of outputs, group of inputs).
// Q8 and Q4 multiply int8 activations, quantized per row (scale = amax/127), with exact int32
// dot products; so a row's result never depends on the other rows in the batch.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "huge_pages.h"

namespace sapwood {

enum class WFormat { F32, BF16, Q8, Q4 };
WFormat parse_wformat(const char* s);  // "f32" | "bf16" | "q8" | "q4"

constexpr int kOutBlock = 16;   // F32/BF16 output block
constexpr int kQ4Group = 64;

struct QMatrix {
  WFormat fmt = WFormat::F32;
  int rows = 0, cols = 0;
  int cols_pad = 0;                 // Q8: multiple of 32; Q4: multiple of 64
  BigVector<float> f32;
  BigVector<uint16_t> bf16;
  BigVector<int8_t> q8;
  std::vector<int32_t> q8_sum;      // Q8: each row's sum of int8 weights (unsigned-x dot kernels)
  BigVector<uint8_t> q4;
  std::vector<float> scale;
  std::vector<float> bias;          // Q4 affine: per [rows][groups]; empty: symmetric Q4
  int group = kQ4Group;             // Q4: inputs per scale (and bias): 64, or 32 (affine only)

  void quantize(const float* w, int rows, int cols, WFormat fmt);  // init, then set_rows
  // Streaming: init sizes the storage (zero padding), then set_row(o, w) stores row o of W
  // (cols floats); rows may be set in any order, from several threads at once.
  void init(int rows, int cols, WFormat fmt);
  void set_row(int o, const float* w);
  // Rows o0 .. o0 + n - 1 (w: n rows `stride` floats apart). With o0 a multiple of 16 the
  // interleaved formats write each group's bytes in order (set_row scatters 4-byte runs 64
  // bytes apart), the way a load fills a matrix.
  void set_rows(int o0, int n, const float* w, size_t stride);
  // Q4 affine, as stored: init_affine sizes it; set_affine_rows stores rows [o0, o0 + n) from
  // the row-major layout (q4_plain_byte: nibbles [n][cols_pad / 2], scales and biases
  // [n][groups]).
  void init_affine(int rows, int cols, int group = kQ4Group);
  void set_affine_rows(int o0, int n, const uint8_t* nibbles, const float* scales,
                       const float* biases);
  bool affine() const { return !bias.empty(); }
  int groups() const { return cols_pad / group; }  // Q4: scales (and biases) a row
  static constexpr int kQ8Group = 16, kQ8Quad = 4;
  static constexpr int kQ8QuadBytes = kQ8Group * kQ8Quad;  // 64: one quad of a group
  // Q8: where input k of output o sits (row padding to 16 outputs stays zero)
  size_t q8_index(int o, int k) const {
    return size_t(o / kQ8Group) * kQ8Group * cols_pad + size_t(k / kQ8Quad) * kQ8QuadBytes +
           size_t(o % kQ8Group) * kQ8Quad + k % kQ8Quad;
  }
  // Q4: the byte that holds input k of output o, whether in its high nibble, and where the
  // scale (and bias) of output o's input group g sits
  static constexpr int kQ4Block = kQ4Group * kQ8Group / 2;  // 512 bytes: 64 inputs x 16 outputs
  size_t q4_byte(int o, int k) const {
    const int j = k % kQ4Group;
    return (size_t(o / kQ8Group) * (cols_pad / kQ4Group) + k / kQ4Group) * kQ4Block +
           (j % 32) / 4 * 64 + (o % kQ8Group) * 4 + j % 4;
  }
  static bool q4_high(int k) { return k % kQ4Group >= 32; }
  size_t q4_scale_index(int o, int g) const {
    return (size_t(o / kQ8Group) * groups() + g) * kQ8Group + o % kQ8Group;
  }
  // The row-major Q4 layout sources hand over and the GPU kernels read: nibbles
  // [rows][cols_pad / 2] (a run of 64 inputs in 32 bytes; groups of 64: byte j holds input j
  // low and j + 32 high; groups of 32: bytes 16i + j hold inputs 32i + j and 32i + j + 16),
  // scales and biases (affine) [rows][groups]. q4_plain exports it; set_affine_rows takes it.
  size_t q4_plain_byte(int o, int k) const {
    const int j = k % kQ4Group, half = group / 2;
    return (size_t(o) * cols_pad + (k - j)) / 2 + (j / group) * half + j % half;
  }
  bool q4_plain_high(int k) const { return (k % group) >= group / 2; }
  void q4_plain(std::vector<uint8_t>* nibbles, std::vector<float>* scales,
                std::vector<float>* biases) const;
  size_t bytes() const;
  void dequant_row(int r, float* out) const;  // the weights as the matmul sees them
};

// Row-wise int8 activations for Q8/Q4: xq [n][cols_pad] (zero padded), xs [n].
struct QActs {
  int n = 0, cols_pad = 0;
  std::vector<int8_t> xq;
  std::vector<float> xs;
  void quantize(const float* x, int n, int cols, int cols_pad);
};

uint16_t f32_to_bf16(float x);
inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

}  // namespace sapwood

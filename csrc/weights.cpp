#include "weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"
#include "kernels/kernels.h"

namespace sapwood {

WFormat parse_wformat(const char* s) {
  std::string f(s);
  if (f == "f32") return WFormat::F32;
  if (f == "bf16") return WFormat::BF16;
  if (f == "q8") return WFormat::Q8;
  if (f == "q4") return WFormat::Q4;
  throw InputError(cat("weights format must be one of f32, bf16, q8, q4; got '", f, "'"));
}

uint16_t f32_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even (inputs are finite)
  return uint16_t(u >> 16);
}

static int round_up(int x, int m) { return (x + m - 1) / m * m; }

void QMatrix::init(int r, int c, WFormat f) {
  fmt = f, rows = r, cols = c, cols_pad = 0, group = kQ4Group;
  f32.clear(), bf16.clear(), q8.clear(), q8_sum.clear(), q4.clear(), scale.clear(), bias.clear();
  // Storage is left unwritten (BigVector): set_row(s) write every byte of every row, padding
  // inputs included. Only the padding outputs of the last group of 16 are zeroed here: the
  // kernels read them.
  const size_t r16 = size_t(round_up(r, kOutBlock)), last = r16 >= kOutBlock ? r16 - kOutBlock : 0;
  if (f == WFormat::F32) {
    f32.resize(r16 * c);
    std::fill(f32.begin() + last * c, f32.end(), 0.0f);
  } else if (f == WFormat::BF16) {
    bf16.resize(r16 * c);
    std::fill(bf16.begin() + last * c, bf16.end(), uint16_t(0));
  } else if (f == WFormat::Q8) {
    cols_pad = round_up(c, 32);
    q8.resize(r16 * cols_pad);
    std::fill(q8.begin() + last * cols_pad, q8.end(), int8_t(0));
    scale.assign(r, 0.0f);
    q8_sum.assign(r, 0);
  } else {
    cols_pad = round_up(c, kQ4Group);
    q4.resize(r16 * cols_pad / 2);
    std::fill(q4.begin() + last * cols_pad / 2, q4.end(), uint8_t(0));
    scale.assign(r16 * groups(), 0.0f);
  }
}

// Q4: output o's 32 bytes of inputs 64s .. 64s + 63 (byte j: input j low, j + 32 high) into
// their block, 4 bytes a slot
static void q4_put_run(QMatrix& m, int o, int s, const uint8_t* bytes) {
  uint8_t* dst = &m.q4[m.q4_byte(o, s * kQ4Group)];
  for (int t = 0; t < 8; ++t) std::memcpy(dst + t * 64, bytes + 4 * t, 4);
}

// A 64-input run of groups of 32 between the plain order (byte 16i + j: inputs 32i + j low,
// 32i + j + 16 high) and the block order (byte j: inputs j, j + 32): byte j's high nibble
// trades places with byte 16 + j's low one, so the same swap goes both ways
static void q4_swap_g32(const uint8_t* in, uint8_t* out) {
  for (int j = 0; j < 16; ++j) {
    out[j] = uint8_t((in[j] & 0x0F) | (in[16 + j] << 4));
    out[16 + j] = uint8_t((in[j] >> 4) | (in[16 + j] & 0xF0));
  }
}

// Rows touch disjoint bytes (a Q4 byte holds two inputs of one row), so loaders fill rows from
// several threads at once.
void QMatrix::set_row(int o, const float* w) {
  const int c = cols;
  if (fmt == WFormat::F32 || fmt == WFormat::BF16) {
    for (int k = 0; k < c; ++k) {
      const size_t i = (size_t(o / kOutBlock) * c + k) * kOutBlock + o % kOutBlock;
      if (fmt == WFormat::F32) f32[i] = w[k];
      else bf16[i] = f32_to_bf16(w[k]);
    }
  } else if (fmt == WFormat::Q8) {
    thread_local std::vector<int8_t> row;
    row.assign(cols_pad, 0);  // padding inputs stored as zeros too
    int8_t* q = row.data();
    int32_t sum = 0;
    scale[o] = quantize_block(w, c, 127.0f, q);
    for (int k = 0; k < cols_pad; ++k) q8[q8_index(o, k)] = q[k], sum += q[k];
    q8_sum[o] = sum;
  } else {
    for (int g = 0; g < groups(); ++g) {
      const int k0 = g * kQ4Group, k1 = std::min(c, k0 + kQ4Group);
      int8_t qs[kQ4Group] = {};  // inputs past cols stay 0: stored 8
      scale[q4_scale_index(o, g)] = quantize_block(w + k0, k1 - k0, 7.0f, qs);
      uint8_t v[kQ4Group / 2];
      for (int j = 0; j < kQ4Group / 2; ++j) v[j] = uint8_t((qs[j] + 8) | ((qs[j + 32] + 8) << 4));
      q4_put_run(*this, o, g, v);
    }
  }
}

void QMatrix::set_rows(int o0, int n, const float* w, size_t stride) {
  if (o0 % kQ8Group != 0 || n > kQ8Group || fmt == WFormat::Q4) {
    for (int i = 0; i < n; ++i) set_row(o0 + i, w + size_t(i) * stride);
    return;
  }
  const int c = cols;
  if (fmt == WFormat::Q8) {
    thread_local std::vector<int8_t> q;
    q.assign(size_t(kQ8Group) * cols_pad, 0);
    for (int i = 0; i < n; ++i) {
      int8_t* qi = &q[size_t(i) * cols_pad];
      scale[o0 + i] = quantize_block(w + size_t(i) * stride, c, 127.0f, qi);
      int32_t sum = 0;
      for (int k = 0; k < c; ++k) sum += qi[k];
      q8_sum[o0 + i] = sum;
    }
    int8_t* dst = &q8[q8_index(o0, 0)];
    for (int quad = 0; quad < cols_pad / kQ8Quad; ++quad)
      for (int i = 0; i < n; ++i)
        std::memcpy(dst + size_t(quad) * kQ8QuadBytes + i * kQ8Quad, &q[size_t(i) * cols_pad + quad * kQ8Quad],
                    kQ8Quad);
    return;
  }
  const size_t base = size_t(o0 / kOutBlock) * c * kOutBlock;  // F32 / BF16: [k][16 outputs]
  for (int k = 0; k < c; ++k)
    for (int i = 0; i < n; ++i) {
      const float x = w[size_t(i) * stride + k];
      if (fmt == WFormat::F32) f32[base + size_t(k) * kOutBlock + i] = x;
      else bf16[base + size_t(k) * kOutBlock + i] = f32_to_bf16(x);
    }
}

void QMatrix::init_affine(int r, int c, int g) {
  SW_CHECK(g == 32 || g == kQ4Group, "affine 4-bit groups of 32 or 64 inputs, got ", g);
  init(r, c, WFormat::Q4);
  group = g;
  scale.assign(size_t(round_up(r, kQ8Group)) * groups(), 0.0f);
  bias.assign(scale.size(), 0.0f);
}

void QMatrix::set_affine_rows(int o0, int n, const uint8_t* nibbles, const float* scales,
                              const float* biases) {
  const size_t row = size_t(cols_pad) / 2;
  const int G = groups(), half = group / 2;
  for (int r = 0; r < n; ++r) {
    const uint8_t* src = nibbles + size_t(r) * row;
    for (int s = 0; s < cols_pad / kQ4Group; ++s, src += kQ4Group / 2) {
      if (half == 32) {  // groups of 64: the plain run is already byte j = inputs j, j + 32
        q4_put_run(*this, o0 + r, s, src);
        continue;
      }
      uint8_t v[kQ4Group / 2];
      q4_swap_g32(src, v);
      q4_put_run(*this, o0 + r, s, v);
    }
    for (int g = 0; g < G; ++g) {
      scale[q4_scale_index(o0 + r, g)] = scales[size_t(r) * G + g];
      bias[q4_scale_index(o0 + r, g)] = biases[size_t(r) * G + g];
    }
  }
}

void QMatrix::quantize(const float* w, int r, int c, WFormat f) {
  init(r, c, f);
  for (int o = 0; o < r; o += kQ8Group) set_rows(o, std::min(kQ8Group, r - o), w + size_t(o) * c, size_t(c));
}

void QMatrix::q4_plain(std::vector<uint8_t>* nibbles, std::vector<float>* scales,
                       std::vector<float>* biases) const {
  const int G = groups();
  nibbles->assign(size_t(rows) * cols_pad / 2, 0);
  scales->resize(size_t(rows) * G);
  biases->resize(affine() ? size_t(rows) * G : 0);
  for (int o = 0; o < rows; ++o) {
    for (int s = 0; s < cols_pad / kQ4Group; ++s) {  // set_affine_rows backwards
      uint8_t v[kQ4Group / 2], *dst = nibbles->data() + q4_plain_byte(o, s * kQ4Group);
      const uint8_t* src = &q4[q4_byte(o, s * kQ4Group)];
      for (int t = 0; t < 8; ++t) std::memcpy(v + 4 * t, src + t * 64, 4);
      if (group == kQ4Group) std::memcpy(dst, v, sizeof v);
      else q4_swap_g32(v, dst);
    }
    for (int g = 0; g < G; ++g) {
      (*scales)[size_t(o) * G + g] = scale[q4_scale_index(o, g)];
      if (affine()) (*biases)[size_t(o) * G + g] = bias[q4_scale_index(o, g)];
    }
  }
}

size_t QMatrix::bytes() const {
  return f32.size() * 4 + bf16.size() * 2 + q8.size() + q8_sum.size() * 4 + q4.size() +
         scale.size() * 4 + bias.size() * 4;
}

void QMatrix::dequant_row(int o, float* out) const {
  switch (fmt) {
    case WFormat::F32:
    case WFormat::BF16:
      for (int k = 0; k < cols; ++k) {
        const size_t i = (size_t(o / kOutBlock) * cols + k) * kOutBlock + o % kOutBlock;
        out[k] = fmt == WFormat::F32 ? f32[i] : bf16_to_f32(bf16[i]);
      }
      break;
    case WFormat::Q8:
      for (int k = 0; k < cols; ++k) out[k] = float(q8[q8_index(o, k)]) * scale[o];
      break;
    case WFormat::Q4: {
      for (int k = 0; k < cols; ++k) {
        const uint8_t b = q4[q4_byte(o, k)];
        const int n = q4_high(k) ? (b >> 4) : (b & 0xF);
        const size_t g = q4_scale_index(o, k / group);
        // affine: what formats.MlxAffine reads, scale * q + bias in float32 (no fma)
        out[k] = affine() ? float(n) * scale[g] + bias[g] : float(n - 8) * scale[g];
      }
      break;
    }
  }
}

void QActs::quantize(const float* x, int rows, int cols, int pad) {
  n = rows, cols_pad = pad;
  xq.assign(size_t(rows) * pad, 0);
  xs.resize(rows);
  for (int r = 0; r < rows; ++r)
    xs[r] = kernels().quantize_row(x + size_t(r) * cols, cols, 127.0f, xq.data() + size_t(r) * pad);
}

}  // namespace sapwood

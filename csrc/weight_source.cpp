#include "weight_source.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>

#include "common.h"
#include "thread_pool.h"

namespace sapwood {

size_t src_dtype_size(SrcDtype t) { return t == SrcDtype::F32 ? 4 : 2; }

bool MapSource::shape(const std::string& name, std::vector<int64_t>* shape) const {
  auto it = t_.find(name);
  if (it == t_.end()) return false;
  *shape = it->second.shape;
  return true;
}

const void* MapSource::rows(const std::string& name, int64_t r0, int64_t, SrcDtype* dtype) {
  const Tensor& x = t_.at(name);
  size_t cols = 1;
  for (size_t i = 1; i < x.shape.size(); ++i) cols *= size_t(x.shape[i]);
  *dtype = SrcDtype::F32;
  return x.data + size_t(r0) * cols;
}

namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finalizer: row hashes are summed, so spread them
  x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27, x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

float f16_to_f32(uint16_t h) {  // exact: every half is a float
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24
    const float f = float(man) * 5.9604644775390625e-08f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void widen(const void* src, SrcDtype t, int64_t n, float* out) {
  const auto* u = static_cast<const uint16_t*>(src);
  if (t == SrcDtype::BF16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t b = uint32_t(u[i]) << 16;
      std::memcpy(out + i, &b, 4);
    }
  } else if (t == SrcDtype::F16) {
    for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(u[i]);
  } else {
    std::memcpy(out, src, size_t(n) * 4);
  }
}

int64_t first_non_finite(const float* x, int64_t n) {
  uint32_t any = 0;  // an OR over the words vectorises; the element is looked up on failure only
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    any |= uint32_t((b & 0x7f800000u) == 0x7f800000u);
  }
  for (int64_t i = 0; any && i < n; ++i)
    if (!std::isfinite(x[i])) return i;
  return -1;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

void WeightLoader::check_shape(const std::string& name, const std::vector<int64_t>& want) const {
  std::vector<int64_t> got;
  SW_CHECK(src_.shape(name, &got), "missing weight tensor '", name, "'");
  SW_CHECK(got == want, "weight '", name, "' has shape ", shape_str(got), ", expected ",
           shape_str(want));
}

void WeightLoader::stream(const std::string& name, int64_t rows, int64_t cols, BlockFn fn,
                          void* obj) {
  const int64_t B = kBlockRows;  // chunks and jobs start on block boundaries
  const int64_t per = std::max<int64_t>(1, int64_t(src_.chunk_bytes() / size_t(cols * 4)) / B) * B;
  std::atomic<uint64_t> sum{0};
  std::mutex bad_mu;
  int64_t bad = -1;  // the first non-finite value's flat index, and the value
  float bad_value = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += per) {
    const int64_t r1 = std::min(rows, r0 + per), n = r1 - r0, blocks = (n + B - 1) / B;
    SrcDtype t = SrcDtype::F32;
    const char* p = static_cast<const char*>(src_.rows(name, r0, r1, &t));
    const size_t row_bytes = size_t(cols) * src_dtype_size(t);
    const int jobs = int(std::min<int64_t>(blocks, std::max(1, threads_)));
    parallel_for(jobs, threads_, [&](int j) {
      thread_local std::vector<float> buf;
      buf.resize(size_t(B * cols));
      uint64_t local = 0;
      for (int64_t b = blocks * j / jobs; b < blocks * (j + 1) / jobs; ++b) {
        const int64_t i0 = b * B, m = std::min(B, n - i0);
        const void* raw = p + size_t(i0) * row_bytes;
        const float* x = t == SrcDtype::F32 ? static_cast<const float*>(raw) : buf.data();
        if (t != SrcDtype::F32) widen(raw, t, m * cols, buf.data());
        bool ok = true;
        for (int64_t i = 0; i < m; ++i) {
          const float* row = x + size_t(i * cols);
          const int64_t k = first_non_finite(row, cols);
          if (k >= 0) {
            std::lock_guard<std::mutex> lock(bad_mu);
            const int64_t flat = (r0 + i0 + i) * cols + k;
            if (bad < 0 || flat < bad) bad = flat, bad_value = row[k];
            ok = false;
            continue;
          }
          WeightHasher h;
          h.data(row, size_t(cols));
          local += mix(h.h ^ mix(uint64_t(r0 + i0 + i)));
        }
        if (ok) fn(obj, r0 + i0, int(m), x);
      }
      sum.fetch_add(local, std::memory_order_relaxed);
    });
    SW_CHECK(bad < 0, name, " has a non-finite value ", bad_value, " at flat index ", bad);
  }
  WeightHasher h;
  h.bytes(name.data(), name.size());
  h.value(rows), h.value(cols), h.value(sum.load());
  hashes_[name] = h.h;
}

QMatrix WeightLoader::matrix(const std::string& name, int rows, int cols, WFormat f) {
  check_shape(name, {rows, cols});
  QMatrix m;
  const int group = src_.q4_affine_group(name);
  if ((f == WFormat::Q8 || f == WFormat::Q4) && group) {
    // a quantized load keeps a pre-quantized 4-bit matrix as stored: quantizing its values
    // again would round them twice
    SW_CHECK(cols % kQ4Group == 0, name, ": affine 4-bit groups need ", kQ4Group,
             " | cols, got ", cols);
    m.init_affine(rows, cols, group);
    stream_q4_affine(name, &m);
    return m;
  }
  m.init(rows, cols, f);
  each_block(name, rows, cols,
             [&](int64_t r0, int n, const float* x) { m.set_rows(int(r0), n, x, size_t(cols)); });
  return m;
}

std::vector<float> WeightLoader::vector(const std::string& name, const std::vector<int64_t>& shape) {
  check_shape(name, shape);
  int64_t cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
  const int64_t rows = shape.empty() ? 1 : shape[0];
  std::vector<float> out(size_t(rows * cols));
  each_row(name, rows, cols,
           [&](int64_t r, const float* x) { std::memcpy(&out[size_t(r * cols)], x, size_t(cols) * 4); });
  return out;
}

void WeightLoader::stream_q4_affine(const std::string& name, QMatrix* m) {
  const int64_t rows = m->rows, groups = m->groups(), row = m->cols_pad / 2;
  // chunks as many rows as a float chunk: the source unpacks a chunk's values on the way
  const int64_t per = std::max<int64_t>(1, int64_t(src_.chunk_bytes()) / (int64_t(m->cols) * 4));
  uint64_t sum = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += per) {
    const int64_t r1 = std::min(rows, r0 + per);
    const uint8_t* nib = nullptr;
    const float *sc = nullptr, *bi = nullptr;
    src_.q4_affine_rows(name, r0, r1, &nib, &sc, &bi);
    for (int64_t i = 0; i < (r1 - r0) * groups; ++i)
      SW_CHECK(std::isfinite(sc[i]) && std::isfinite(bi[i]), name, " has a non-finite ",
               std::isfinite(sc[i]) ? "bias " : "scale ", std::isfinite(sc[i]) ? bi[i] : sc[i],
               " at group ", r0 * groups + i);
    m->set_affine_rows(int(r0), int(r1 - r0), nib, sc, bi);
    for (int64_t r = r0; r < r1; ++r) {  // the stored bytes enter the fingerprint, row by row
      WeightHasher h;
      h.bytes(nib + size_t(r - r0) * row, size_t(row));
      h.data(sc + size_t(r - r0) * groups, size_t(groups));
      h.data(bi + size_t(r - r0) * groups, size_t(groups));
      sum += mix(h.h ^ mix(uint64_t(r)));
    }
  }
  WeightHasher h;
  h.bytes(name.data(), name.size());
  h.value(rows), h.value(int64_t(m->cols)), h.value(sum), h.value(uint64_t(0xaff1e));
  if (m->group != kQ4Group) h.value(int64_t(m->group));
  hashes_[name] = h.h;
}

uint64_t WeightLoader::fingerprint() const {
  WeightHasher h;
  for (const auto& [name, v] : hashes_) h.value(v);  // a std::map: in name order
  return h.h;
}

}  // namespace sapwood

// Boundary checks shared by the binding files: strict dtypes, shapes, finite values, ints.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common.h"
#include "kv_cache.h"
#include "model.h"

namespace sapwood {
namespace py = pybind11;
using F32 = py::array_t<float, py::array::c_style>;

inline std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// A float32 array of the given shape (-1 = any); contiguous copy if needed. Strict dtype.
inline F32 as_f32(py::handle obj, const char* name, std::vector<py::ssize_t> shape, bool finite = true) {
  if (!py::isinstance<py::array>(obj))
    throw InputError(cat(name, " must be a numpy float32 array, got ",
                         std::string(py::str(py::type::handle_of(obj)))));
  py::array a = py::reinterpret_borrow<py::array>(obj);
  if (!a.dtype().is(py::dtype::of<float>()))
    throw InputError(cat(name, " must have dtype float32, got ", std::string(py::str(a.dtype()))));
  bool ok = a.ndim() == py::ssize_t(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || a.shape(i) == shape[i];
  if (!ok) {
    std::string want = "(";
    for (size_t i = 0; i < shape.size(); ++i)
      want += (i ? ", " : "") + (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
    throw InputError(cat(name, " has shape ", shape_str(a), ", expected ", want, ")"));
  }
  F32 out = F32::ensure(a);
  if (finite) {
    // An OR of "all exponent bits set" (inf or NaN) over the words vectorises; the element is
    // looked up only on failure (a checkpoint's weights pass through here at load).
    const float* p = out.data();
    uint32_t bad = 0;
    for (py::ssize_t i = 0; i < out.size(); ++i) {
      uint32_t b;
      std::memcpy(&b, p + i, sizeof b);
      bad |= uint32_t((b & 0x7f800000u) == 0x7f800000u);
    }
    for (py::ssize_t i = 0; bad && i < out.size(); ++i)
      if (!std::isfinite(p[i]))
        throw InputError(cat(name, " has a non-finite value ", p[i], " at flat index ", i));
  }
  return out;
}

// Any integer array-like -> int32 vector, range-checked.
inline std::vector<int> as_ints(py::handle obj, const char* name) {
  py::array a = py::array::ensure(obj);
  if (!a || a.ndim() != 1)
    throw InputError(cat(name, " must be a 1-D sequence of integers"));
  if (a.size() == 0) return {};
  if (a.dtype().kind() != 'i' && a.dtype().kind() != 'u')
    throw InputError(cat(name, " must contain integers, got dtype ", std::string(py::str(a.dtype()))));
  auto v = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  std::vector<int> out(v.size());
  for (py::ssize_t i = 0; i < v.size(); ++i) {
    const int64_t x = v.data()[i];
    if (x < INT32_MIN || x > INT32_MAX) throw InputError(cat(name, "[", i, "] = ", x, " out of range"));
    out[i] = int(x);
  }
  return out;
}

// A float32 array [rows][cols] (rows < 0: [cols]) owning v's storage.
inline py::array_t<float> to_array(std::vector<float>&& v, py::ssize_t rows, py::ssize_t cols) {
  auto* heap = new std::vector<float>(std::move(v));
  py::capsule free_when_done(heap, [](void* p) { delete reinterpret_cast<std::vector<float>*>(p); });
  if (rows < 0) return py::array_t<float>({cols}, {sizeof(float)}, heap->data(), free_when_done);
  return py::array_t<float>({rows, cols}, {cols * py::ssize_t(sizeof(float)), py::ssize_t(sizeof(float))},
                            heap->data(), free_when_done);
}

// {name: float32 array} -> TensorMap viewing the arrays, which *keep holds (keep it alive while
// the map is read).
inline TensorMap tensor_map(const py::dict& weights, std::vector<F32>* keep) {
  TensorMap t;
  keep->reserve(keep->size() + weights.size());
  for (auto item : weights) {
    const std::string name = py::str(item.first);
    py::array a = py::array::ensure(item.second);
    keep->push_back(as_f32(item.second, name.c_str(), std::vector<py::ssize_t>(a ? a.ndim() : 0, -1)));
    Tensor x{keep->back().data(), {}};
    for (py::ssize_t i = 0; i < keep->back().ndim(); ++i) x.shape.push_back(keep->back().shape(i));
    t.emplace(name, x);
  }
  return t;
}

// A TensorSource over a Python object streaming a checkpoint (loading.StreamingSource):
// `shapes` {name: shape} read once, `read(name, r0, r1)` -> a C-contiguous array of rows
// [r0, r1) as float32, float16, or uint16 holding bfloat16 bits. Called from the loading thread
// with the GIL released around it; each array is kept until the next call.
class PySource : public TensorSource {
 public:
  explicit PySource(py::handle obj) : obj_(py::reinterpret_borrow<py::object>(obj)) {
    if (!py::hasattr(obj, "shapes") || !py::hasattr(obj, "read"))
      throw InputError("weights must be a dict of float32 arrays or a source with shapes and read()");
    for (auto item : obj.attr("shapes").cast<py::dict>())
      shapes_[py::str(item.first)] = item.second.cast<std::vector<int64_t>>();
    if (py::hasattr(obj, "chunk_bytes")) chunk_ = obj.attr("chunk_bytes").cast<size_t>();
    if (py::hasattr(obj, "q4_affine_names"))
      for (auto item : obj.attr("q4_affine_names").cast<py::dict>())  // name: group size
        affine_[py::str(item.first)] = item.second.cast<int>();
  }
  int q4_affine_group(const std::string& name) const override {
    auto it = affine_.find(name);
    return it == affine_.end() ? 0 : it->second;
  }
  void q4_affine_rows(const std::string& name, int64_t r0, int64_t r1, const uint8_t** nibbles,
                      const float** scales, const float** biases) override {
    py::gil_scoped_acquire gil;
    held_ = py::object();
    py::tuple t = obj_.attr("read_q4_affine")(name, r0, r1);
    SW_CHECK(t.size() == 3, "weights source: read_q4_affine('", name, "') must return 3 arrays");
    const std::vector<int64_t>& s = shapes_.at(name);
    const size_t n = size_t(r1 - r0), cols = size_t(s.at(1));
    auto nib = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>::ensure(t[0]);
    auto sc = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(t[1]);
    auto bi = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(t[2]);
    SW_CHECK(nib && sc && bi && size_t(nib.size()) == n * cols / 2 &&
                 size_t(sc.size()) == n * cols / affine_.at(name) &&
                 size_t(bi.size()) == n * cols / affine_.at(name),
             "weights source: read_q4_affine('", name, "', ", r0, ", ", r1, ") returned arrays "
             "of the wrong sizes");
    held_ = py::make_tuple(nib, sc, bi);
    *nibbles = nib.data(), *scales = sc.data(), *biases = bi.data();
  }
  ~PySource() override {
    py::gil_scoped_acquire gil;
    held_ = py::object();
    obj_ = py::object();
  }
  bool shape(const std::string& name, std::vector<int64_t>* shape) const override {
    auto it = shapes_.find(name);
    if (it == shapes_.end()) return false;
    *shape = it->second;
    return true;
  }
  const void* rows(const std::string& name, int64_t r0, int64_t r1, SrcDtype* dtype) override {
    py::gil_scoped_acquire gil;
    held_ = py::object();  // the previous chunk goes before the next is read
    py::array a = py::array::ensure(obj_.attr("read")(name, r0, r1));
    if (!a || !(a.flags() & py::array::c_style))
      throw InputError(cat("weights source: read('", name, "') must return a C-contiguous array"));
    const char kind = a.dtype().kind();
    const size_t item = size_t(a.itemsize());
    if (kind == 'f' && item == 4) *dtype = SrcDtype::F32;
    else if (kind == 'f' && item == 2) *dtype = SrcDtype::F16;
    else if (kind == 'u' && item == 2) *dtype = SrcDtype::BF16;
    else
      throw InputError(cat("weights source: read('", name, "') returned dtype ",
                           std::string(py::str(a.dtype())), " (float32, float16 or uint16 bf16 bits)"));
    const std::vector<int64_t>& s = shapes_.at(name);
    size_t cols = 1;
    for (size_t i = 1; i < s.size(); ++i) cols *= size_t(s[i]);
    SW_CHECK(size_t(a.size()) == size_t(r1 - r0) * cols, "weights source: read('", name, "', ",
             r0, ", ", r1, ") returned ", a.size(), " values, expected ", size_t(r1 - r0) * cols);
    held_ = a;
    return a.data();
  }
  size_t chunk_bytes() const override { return chunk_; }

 private:
  py::object obj_, held_;
  std::map<std::string, std::vector<int64_t>> shapes_;
  std::map<std::string, int> affine_;
  size_t chunk_ = size_t(32) << 20;
};

// The weights argument of a constructor: a {name: float32 array} dict or a streaming source.
struct WeightsArg {
  std::vector<F32> keep;
  TensorMap map;
  std::unique_ptr<TensorSource> src;  // declared last: destroyed first, before what it reads
  explicit WeightsArg(py::handle w) {
    if (py::isinstance<py::dict>(w)) {
      map = tensor_map(py::reinterpret_borrow<py::dict>(w), &keep);
      src = std::make_unique<MapSource>(map);
    } else {
      src = std::make_unique<PySource>(w);
    }
  }
};

inline KVDtype parse_kv_dtype(const std::string& s) {
  if (s == "int8") return KVDtype::Int8;
  if (s == "f32") return KVDtype::F32;
  throw InputError(cat("KV dtype must be 'int8' or 'f32', got '", s, "'"));
}

template <class T>
inline T need(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw InputError(cat("dims is missing '", key, "'"));
  try {
    return d[key].cast<T>();
  } catch (const py::cast_error&) {
    throw InputError(cat("dims['", key, "'] has the wrong type"));
  }
}

// The `dims` dict of loading.engine_dims -> ModelDims, each key checked.
inline ModelDims parse_dims(const py::dict& d) {
  ModelDims m;
  m.vocab = need<int>(d, "vocab_size");
  m.hidden = need<int>(d, "hidden_size");
  m.inter = need<int>(d, "intermediate_size");
  m.is_attn = need<std::vector<bool>>(d, "layer_is_attention");
  m.n_heads = need<int>(d, "num_heads");
  m.n_kv_heads = need<int>(d, "num_kv_heads");
  m.head_dim = need<int>(d, "head_dim");
  m.rotary_dim = need<int>(d, "rotary_dim");
  m.rope_theta = need<float>(d, "rope_theta");
  m.eps = need<float>(d, "rms_norm_eps");
  m.tied = need<bool>(d, "tie_word_embeddings");
  m.hk = need<int>(d, "hk");
  m.dk = need<int>(d, "dk");
  m.hv = need<int>(d, "hv");
  m.dv = need<int>(d, "dv");
  m.conv_k = need<int>(d, "conv_kernel");
  const std::string order = need<std::string>(d, "head_order");
  SW_CHECK(order == "grouped" || order == "tiled", "head_order must be 'grouped' or 'tiled', got '",
           order, "'");
  m.tiled = order == "tiled";
  return m;
}

}  // namespace sapwood

// pybind11 module sapwood._core: kernel-level entry points (KV pages, tree attention, pathwise
// GDN) and, later, the Engine. Every array is checked at this boundary (dtype, shape, values)
// and errors become Python exceptions naming the offending value; the GIL is released while
// kernels run.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cmath>

#include "bindings_util.h"
#include "huge_pages.h"
#include "common.h"
#include "exclusive.h"
#include "gdn_layer.h"
#include "kernels/kernels.h"
#include "kv_cache.h"
#include "thread_pool.h"
#include "tree.h"

namespace py = pybind11;
using namespace sapwood;

namespace {

// KVSequence and GDNLayer as handed to Python: with an Exclusive (exclusive.h) that every
// method holds, since tree_attention and the GDN layer's compute run with the GIL released and
// a call from a second thread meanwhile (an append moving the page table, a commit moving the
// state) corrupted what they read. A second thread gets EngineBusyError.
struct PyKVSequence : KVSequence {
  using KVSequence::KVSequence;
  Exclusive exclusive;
};
struct PyGDNLayer : GDNLayer {
  using GDNLayer::GDNLayer;
  Exclusive exclusive;
};
constexpr const char* kSeqBusy =
    "KVSequence is in use by another thread: it runs one call at a time (give each thread its "
    "own, or serialise the calls)";
constexpr const char* kGdnBusy =
    "GDNLayer is in use by another thread: it runs one call at a time (give each thread its "
    "own, or serialise the calls)";

// Tree k/v [N, Hkv, D] roundtripped through the pool's storage format.
std::vector<float> roundtrip_rows(const float* x, size_t rows, int D, KVDtype dt) {
  std::vector<float> out(rows * D);
  for (size_t r = 0; r < rows; ++r) kv_roundtrip(x + r * D, D, dt, out.data() + r * D);
  return out;
}

py::array_t<float> tree_attention_py(PyKVSequence& seq, py::handle q_obj, py::handle k_obj,
                                     py::handle v_obj, py::handle parents_obj, int layer,
                                     int split, int threads) {
  Exclusive::Use use(seq.exclusive, kSeqBusy);  // the kernel reads its pages without the GIL
  KVPagePool& pool = seq.pool();
  const int Hkv = pool.n_kv_heads(), D = pool.head_dim();
  std::vector<int> parents = as_ints(parents_obj, "parents");
  const int N = int(parents.size());
  check_parents(parents.data(), N);
  F32 q = as_f32(q_obj, "q", {N, -1, D});
  const int Hq = int(q.shape(1));
  SW_CHECK(Hq > 0 && Hq % Hkv == 0, "query heads ", Hq, " must be a multiple of KV heads ", Hkv);
  F32 k = as_f32(k_obj, "k_tree", {N, Hkv, D});
  F32 v = as_f32(v_obj, "v_tree", {N, Hkv, D});
  SW_CHECK(layer >= 0 && layer < pool.n_layers(), "layer ", layer, " out of range [0, ",
           pool.n_layers(), ")");
  SW_CHECK(split > 0 && split % kAttnTile == 0, "split must be a positive multiple of ", kAttnTile,
           ", got ", split);
  int stride = 0;
  std::vector<int> anc = ancestor_table(parents.data(), N, &stride);
  std::vector<int> depth = tree_depths(parents.data(), N);
  std::vector<int> row_len(N);
  for (int i = 0; i < N; ++i) row_len[i] = seq.length() + depth[i] + 1;
  py::array_t<float> out({N, Hq, D});
  std::vector<float> kt = roundtrip_rows(k.data(), size_t(N) * Hkv, D, pool.dtype());
  std::vector<float> vt = roundtrip_rows(v.data(), size_t(N) * Hkv, D, pool.dtype());
  AttnProblem pb{N, Hq, Hkv, D, q.data(), out.mutable_data(), row_len.data(), seq.length(), &seq,
                 layer, kt.data(), vt.data(), anc.data(), stride, split,
                 1.0f / std::sqrt(float(D))};
  std::vector<int8_t> kq;
  std::vector<float> ks;
  if (pool.dtype() == KVDtype::Int8) {
    quantize_tree_keys(k.data(), size_t(N) * Hkv, D, &kq, &ks);
    pb.kq_tree = kq.data(), pb.ks_tree = ks.data();
  }
  {
    py::gil_scoped_release release;
    kernels().tree_attention(pb, threads);
  }
  return out;
}

// Append k, v [T, Hkv, D] (single-layer pool) or [L, T, Hkv, D] at the end of the sequence.
void append_py(KVSequence& seq, py::handle k_obj, py::handle v_obj) {
  KVPagePool& pool = seq.pool();
  const int L = pool.n_layers(), Hkv = pool.n_kv_heads(), D = pool.head_dim();
  py::array ka = py::array::ensure(k_obj);
  const bool single = L == 1 && ka && ka.ndim() == 3;
  F32 k = single ? as_f32(k_obj, "k", {-1, Hkv, D}) : as_f32(k_obj, "k", {L, -1, Hkv, D});
  const int T = int(k.shape(single ? 0 : 1));
  F32 v = single ? as_f32(v_obj, "v", {T, Hkv, D}) : as_f32(v_obj, "v", {L, T, Hkv, D});
  const int P = seq.length();
  seq.reserve(P + T);
  const size_t tok = size_t(Hkv) * D;
  for (int l = 0; l < L; ++l)
    for (int t = 0; t < T; ++t)
      seq.write(P + t, l, k.data() + (size_t(l) * T + t) * tok, v.data() + (size_t(l) * T + t) * tok);
  seq.set_length(P + T);
}

py::tuple read_py(const KVSequence& seq, int layer) {
  KVPagePool& pool = seq.pool();
  SW_CHECK(layer >= 0 && layer < pool.n_layers(), "layer ", layer, " out of range");
  const int P = seq.length(), Hkv = pool.n_kv_heads(), D = pool.head_dim(), ps = pool.page_size();
  py::array_t<float> k({P, Hkv, D}), v({P, Hkv, D});
  std::vector<float> kb(D), vb(D);
  for (int p = 0; p < P; ++p)
    for (int h = 0; h < Hkv; ++h) {
      pool.read(seq.page_table()[p / ps], p % ps, 1, layer, h, kb.data(), vb.data());
      std::copy(kb.begin(), kb.end(), k.mutable_data() + (size_t(p) * Hkv + h) * D);
      std::copy(vb.begin(), vb.end(), v.mutable_data() + (size_t(p) * Hkv + h) * D);
    }
  return py::make_tuple(k, v);
}

GDNDims make_dims(int hk, int hv, int dk, int dv, int conv_k, const std::string& order) {
  SW_CHECK(order == "grouped" || order == "tiled", "head_order must be 'grouped' or 'tiled', got '",
           order, "'");
  return GDNDims{hk, hv, dk, dv, conv_k, order == "tiled"};
}

}  // namespace

void bind_engine(py::module_& m);
void bind_tree_growth(py::module_& m);
void bind_gpu(py::module_& m);  // bindings_gpu.cpp
void bind_mtp(py::module_& m);  // bindings_mtp.cpp
void bind_backend_ops(py::module_& m);  // bindings_ops.cpp

PYBIND11_MODULE(_core, m) {
  m.doc() = "sapwood C++ runtime: paged int8 KV, tree attention, pathwise GDN";
  py::register_exception<InputError>(m, "InputError", PyExc_ValueError);
  py::register_exception<CapacityError>(m, "CapacityError", PyExc_MemoryError);

  m.def("isa", [] { return std::string(kernels().name); }, "Kernel variant in use.");
  m.def("available_isas", [] {
    std::vector<std::string> out;
    for (const char* n : {"generic", "avx2", "avx512", "amx"})
      if (kernels_by_name(n)) out.push_back(n);
    return out;
  });
  m.def("set_isa", [](const std::string& name) {
    const KernelTable* t = kernels_by_name(name.c_str());
    SW_CHECK(t, "kernel variant '", name, "' is not built or not supported on this CPU");
    set_kernels(t);
  });
  m.def("set_num_threads", &set_default_threads);
  m.def("min_parallel_work", &min_parallel_work,
        "Regions with less work than this (multiply-adds) run on one thread.");
  m.def("set_min_parallel_work", &set_min_parallel_work, py::arg("work"));
  m.def("read_bandwidth", [](size_t nbytes, int threads, int repeats) {
    // Bytes/s of a parallel streaming read (sum of uint64 words): the memory floor benchmarks
    // compare against. Best of `repeats` after one warm pass. On huge pages where the OS
    // grants them, as the weights are: on 4 KiB pages this read measured 25-26 GB/s where it
    // reads 34 on 2 MiB ones (2-core Xeon, THP on request): the floor's bandwidth ~30% low.
    BigVector<uint64_t> buf(nbytes / 8, 1);
    const int n = std::max(1, threads > 0 ? threads : default_threads());
    std::vector<uint64_t> sums(n);
    double best = 1e30;
    py::gil_scoped_release release;
    for (int r = 0; r <= repeats; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      parallel_for(n, n, [&](int i) {
        size_t lo = buf.size() * i / n, hi = buf.size() * (i + 1) / n;
        uint64_t a = 0, b = 0, c = 0, d = 0;
        for (size_t j = lo; j + 4 <= hi; j += 4) a += buf[j], b += buf[j + 1], c += buf[j + 2], d += buf[j + 3];
        sums[i] = a + b + c + d;
      });
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) best = std::min(best, dt);
    }
    if (sums[0] == 42) best += 0;  // keep the loads alive
    return double(buf.size() * 8) / best;
  }, py::arg("nbytes") = size_t(1) << 29, py::arg("threads") = 0, py::arg("repeats") = 3);
  m.def("int8_peak", [](int threads, double seconds, int repeats) {
    // Multiply-adds/s of the variant in use's int8 microkernel (kernels/peak.inc) run from
    // registers on `threads` threads at once: the compute roof of an int8 matmul or dot.
    // Best of `repeats` after one warm pass, each about `seconds` long.
    SW_CHECK(seconds > 0 && seconds <= 10 && repeats >= 1, "seconds=", seconds,
             " must be in (0, 10] and repeats=", repeats, " >= 1");
    const KernelTable& k = kernels();
    const int n = std::max(1, threads > 0 ? threads : default_threads());
    std::vector<int32_t> sinks(size_t(n) * 16);
    py::gil_scoped_release release;
    long long iters = 1 << 10;
    auto timed = [&](long long it) {
      std::vector<long long> macs(n);
      auto t0 = std::chrono::steady_clock::now();
      parallel_for(n, n, [&](int i) { macs[i] = k.int8_peak(it, &sinks[size_t(i) * 16]); });
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      long long total = 0;
      for (long long m : macs) total += m;
      return std::make_pair(double(total), dt);
    };
    double dt = timed(iters).second;  // calibrate: grow the count until a run is measurable
    for (; dt < 0.01 && iters < (1LL << 40); dt = timed(iters).second) iters *= 4;
    iters = std::max(1LL, (long long)(iters * seconds / dt));
    double best = 0;
    for (int r = 0; r < repeats; ++r) {
      auto [macs, dt] = timed(iters);
      best = std::max(best, macs / dt);
    }
    return best;
  }, py::arg("threads") = 0, py::arg("seconds") = 0.2, py::arg("repeats") = 3);
  m.def("pool_job_counts", [](int n, int threads, int repeats, int raise_at) {
    // How many times each job of `repeats` regions of n jobs ran (the pool's contract: once
    // each); job raise_at (when >= 0) throws in every region, which must reach the caller
    // after the region's other jobs ran. For tests of the pool itself.
    SW_CHECK(n >= 0 && repeats >= 1, "n=", n, " and repeats=", repeats, " must be >= 0 and >= 1");
    std::vector<std::atomic<int>> counts(size_t(std::max(n, 1)));
    int raised = 0;
    py::gil_scoped_release release;
    for (int r = 0; r < repeats; ++r) {
      try {
        parallel_for(n, threads, [&](int i) {
          counts[i].fetch_add(1);
          if (i == raise_at) throw InputError("job " + std::to_string(i));
        });
      } catch (const InputError&) {
        ++raised;
      }
    }
    std::vector<int> out;
    for (int i = 0; i < n; ++i) out.push_back(counts[i].load());
    return std::make_pair(out, raised);
  }, py::arg("n"), py::arg("threads"), py::arg("repeats") = 1, py::arg("raise_at") = -1);
  m.def("arena_chunks", &arena_chunks,
        "Huge-page chunks the weight/KV arena holds now (huge_pages.h); for tests.");
  m.def("get_num_threads", &default_threads);

  m.def("logsumexp", [](py::handle x_obj) {
    F32 x = as_f32(x_obj, "x", {-1});
    SW_CHECK(x.shape(0) > 0, "logsumexp of an empty array");
    return kernels().logsumexp(x.data(), size_t(x.shape(0)));
  }, py::arg("x"), "max(x) + log(sum(exp(x - max))) of float32 x [n] (the draft's ranking).");

  m.def("argmax", [](py::handle x_obj) {
    F32 x = as_f32(x_obj, "x", {-1}, /*finite=*/false);  // NaN and inf have a defined answer
    SW_CHECK(x.shape(0) > 0, "argmax of an empty array");
    return kernels().argmax(x.data(), size_t(x.shape(0)));
  }, py::arg("x"), "The first index of the largest non-NaN x[i] (0 when there is none) of float32 "
     "x [n]: the draft's greedy pick.");
  m.def("top_ids", [](py::handle x_obj, int k, int skip) {
    F32 x = as_f32(x_obj, "x", {-1}, /*finite=*/false);
    const int n = int(x.shape(0));
    SW_CHECK(k >= 0 && k <= n - (skip >= 0 && skip < n ? 1 : 0), "top_ids: k=", k,
             " ids do not fit in ", n, " values (skip ", skip, ")");
    std::vector<int> out(size_t(k), -1);
    kernels().top_ids(x.data(), n, k, skip, out.data());
    return out;
  }, py::arg("x"), py::arg("k"), py::arg("skip") = -1,
     "The k best ids of float32 x [n] other than `skip`, best first, an equal value's lower id "
     "first; NaNs never enter (-1 where fewer qualify): the draft's candidates.");
  m.def("rms_norm", [](py::handle x_obj, py::handle w_obj, float eps, bool inplace) {
    F32 x = as_f32(x_obj, "x", {-1, -1});
    F32 w = as_f32(w_obj, "w", {x.shape(1)});
    // inplace: over x's own buffer, as the engine normalises key heads (x must be C-contiguous:
    // a strided view would be copied, and the caller's array left as it was)
    SW_CHECK(!inplace || x.ptr() == x_obj.ptr(), "rms_norm inplace needs a C-contiguous float32 x");
    F32 out = inplace ? x : F32({x.shape(0), x.shape(1)});
    kernels().rms_norm(x.data(), w.data(), int(x.shape(0)), int(x.shape(1)), eps, out.mutable_data());
    return out;
  }, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("inplace") = false,
     "x [n, d] * rsqrt(mean(x^2) + eps) * w, w [d] the scale as applied (1 + the HF weight).");
  for (const bool silu : {true, false}) {
    const char* name = silu ? "silu_mul" : "sigmoid_mul";
    m.def(name, [silu](py::handle x_obj, py::object u_obj) {
      F32 x = as_f32(x_obj, "x", {-1});
      F32 u;
      if (!u_obj.is_none()) u = as_f32(u_obj, "u", {x.shape(0)});
      py::array_t<float> out(x.shape(0));
      (silu ? kernels().silu_mul : kernels().sigmoid_mul)(
          x.data(), u_obj.is_none() ? nullptr : u.data(), out.mutable_data(), size_t(x.shape(0)));
      return out;
    }, py::arg("x"), py::arg("u") = py::none(),
       silu ? "silu(x) * u (u None: silu(x)), x and u [n]."
            : "sigmoid(x) * u (u None: sigmoid(x)), x and u [n].");
  }

  m.def("quantize_int8", [](py::handle x_obj) {
    F32 x = as_f32(x_obj, "x", {-1, -1});
    const int D = int(x.shape(1));
    SW_CHECK(D % kKVGroup == 0 && D <= 1024, "last dim ", D, " must be a multiple of 32 up to 1024");
    py::array_t<int8_t> q({x.shape(0), x.shape(1)});
    py::array_t<float> s({x.shape(0), py::ssize_t(D / kKVGroup)});
    for (py::ssize_t r = 0; r < x.shape(0); ++r)
      quantize_int8(x.data() + r * D, D, q.mutable_data() + r * D, s.mutable_data() + r * (D / kKVGroup));
    return py::make_tuple(q, s);
  }, "x [rows, D] float32 -> (q int8 [rows, D], scale float32 [rows, D/32])");

  py::class_<QMatrix>(m, "WeightMatrix", "A weight matrix [out, in] in one of the formats.")
      .def(py::init([](py::handle w_obj, const std::string& fmt) {
             F32 w = as_f32(w_obj, "w", {-1, -1});
             auto q = std::make_unique<QMatrix>();
             q->quantize(w.data(), int(w.shape(0)), int(w.shape(1)), parse_wformat(fmt.c_str()));
             return q;
           }),
           py::arg("w"), py::arg("format"))
      .def_static("affine", [](py::array_t<uint8_t, py::array::c_style> q, py::handle scales,
                               py::handle biases) {
             // q [out, in] 4-bit values (0..15), scales / biases [out, in / 64] or [out, in /
             // 32] (the group size follows): the affine Q4 groups a pre-quantized checkpoint
             // stores (formats/ repack MLX's, GGUF's and GPTQ/AWQ's into these)
             SW_CHECK(q.ndim() == 2 && q.shape(1) % kQ4Group == 0, "q must be [out, in] with ",
                      kQ4Group, " | in, got ", shape_str(q));
             const int rows = int(q.shape(0)), cols = int(q.shape(1));
             F32 s = as_f32(scales, "scales", {rows, -1});
             const int groups = int(s.shape(1));
             SW_CHECK(groups == cols / 32 || groups == cols / kQ4Group, "scales must be [", rows,
                      ", ", cols / kQ4Group, "] or [", rows, ", ", cols / 32, "], got ", shape_str(s));
             F32 b = as_f32(biases, "biases", {rows, groups});
             auto m = std::make_unique<QMatrix>();
             m->init_affine(rows, cols, cols / groups);
             std::vector<uint8_t> nib(size_t(rows) * cols / 2);
             for (int r = 0; r < rows; ++r)
               for (int k = 0; k < cols; ++k) {
                 const uint8_t v = q.at(r, k);
                 SW_CHECK(v < 16, "q[", r, ", ", k, "] = ", int(v), ": 4-bit values are 0..15");
                 uint8_t& byte = nib[m->q4_plain_byte(r, k)];
                 byte = uint8_t(m->q4_plain_high(k) ? (byte & 0x0F) | (v << 4) : (byte & 0xF0) | v);
               }
             m->set_affine_rows(0, rows, nib.data(), s.data(), b.data());
             return m;
           },
           py::arg("q"), py::arg("scales"), py::arg("biases"))
      .def("matmul", [](const QMatrix& q, py::handle x_obj, int threads) {
             F32 x = as_f32(x_obj, "x", {-1, q.cols});
             const int n = int(x.shape(0));
             py::array_t<float> y({py::ssize_t(n), py::ssize_t(q.rows)});
             QActs acts;
             {
               py::gil_scoped_release release;
               if (q.fmt == WFormat::Q8 || q.fmt == WFormat::Q4) acts.quantize(x.data(), n, q.cols, q.cols_pad);
               MatmulProblem pb{&q, x.data(), &acts, n, y.mutable_data()};
               kernels().matmul(&pb, 1, threads);
             }
             return y;
           },
           py::arg("x"), py::arg("threads") = 0, "y = x W^T, x [n, in] float32")
      .def("dequantized", [](const QMatrix& q) {
        py::array_t<float> out({q.rows, q.cols});
        for (int r = 0; r < q.rows; ++r) q.dequant_row(r, out.mutable_data() + size_t(r) * q.cols);
        return out;
      })
      .def_property_readonly("nbytes", &QMatrix::bytes);

  py::class_<KVPagePool, std::shared_ptr<KVPagePool>>(m, "KVPagePool")
      .def(py::init([](int num_pages, int page_size, int n_kv_heads, int head_dim, int n_layers,
                       const std::string& dtype) {
             return std::make_shared<KVPagePool>(num_pages, page_size, n_layers, n_kv_heads,
                                                 head_dim, parse_kv_dtype(dtype));
           }),
           py::arg("num_pages"), py::arg("page_size"), py::arg("n_kv_heads"), py::arg("head_dim"),
           py::arg("n_layers") = 1, py::arg("dtype") = "int8")
      .def_property_readonly("free_pages", &KVPagePool::free_pages)
      .def_property_readonly("num_pages", &KVPagePool::num_pages)
      .def_property_readonly("page_size", &KVPagePool::page_size)
      .def_property_readonly("bytes", &KVPagePool::bytes);

  py::class_<PyKVSequence>(m, "KVSequence")
      .def(py::init([](std::shared_ptr<KVPagePool> pool) {
             return std::make_unique<PyKVSequence>(std::move(pool));
           }),
           py::arg("pool"))
      .def_property_readonly("length", [](const PyKVSequence& seq) {
        Exclusive::Use use(seq.exclusive, kSeqBusy);
        return seq.length();
      })
      .def_property_readonly("page_table", [](const PyKVSequence& seq) {
        Exclusive::Use use(seq.exclusive, kSeqBusy);
        return seq.page_table();
      })
      .def("append", [](PyKVSequence& seq, py::handle k, py::handle v) {
        Exclusive::Use use(seq.exclusive, kSeqBusy);
        append_py(seq, k, v);
      }, py::arg("k"), py::arg("v"))
      .def("read", [](const PyKVSequence& seq, int layer) {
        Exclusive::Use use(seq.exclusive, kSeqBusy);
        return read_py(seq, layer);
      }, py::arg("layer") = 0, "Dequantized (k, v) [P, Hkv, D].")
      .def("truncate", [](PyKVSequence& seq, int n) {
        Exclusive::Use use(seq.exclusive, kSeqBusy);
        seq.truncate(n);
      })
      .def("append_nodes", [](PyKVSequence& seq, py::handle k, py::handle v, py::handle parents_obj,
                              py::handle path_obj) {
             // Commit tree nodes `path` (root first) of a single-layer pool.
             Exclusive::Use use(seq.exclusive, kSeqBusy);
             std::vector<int> parents = as_ints(parents_obj, "parents");
             check_parents(parents.data(), int(parents.size()));
             std::vector<int> path = as_ints(path_obj, "path");
             check_path(parents.data(), int(parents.size()), path);
             const int N = int(parents.size()), Hkv = seq.pool().n_kv_heads(), D = seq.pool().head_dim();
             SW_CHECK(seq.pool().n_layers() == 1, "append_nodes is for single-layer pools");
             F32 ka = as_f32(k, "k_tree", {N, Hkv, D}), va = as_f32(v, "v_tree", {N, Hkv, D});
             const int P = seq.length(), n = int(path.size());
             seq.reserve(P + n);
             for (int j = 0; j < n; ++j)
               seq.write(P + j, 0, ka.data() + size_t(path[j]) * Hkv * D,
                         va.data() + size_t(path[j]) * Hkv * D);
             seq.set_length(P + n);
           },
           py::arg("k_tree"), py::arg("v_tree"), py::arg("parents"), py::arg("path"));

  m.def("tree_attention", &tree_attention_py, py::arg("seq"), py::arg("q"), py::arg("k_tree"),
        py::arg("v_tree"), py::arg("parents"), py::arg("layer") = 0, py::arg("split") = 512,
        py::arg("threads") = 0,
        "q [N, Hq, D] attends to the committed positions of seq and to its tree ancestors.");

  py::class_<PyGDNLayer>(m, "GDNLayer")
      .def(py::init([](int hk, int hv, int dk, int dv, py::handle conv_w, const std::string& order,
                       int max_pending) {
             F32 w = as_f32(conv_w, "conv_weight", {-1, -1});
             GDNDims d = make_dims(hk, hv, dk, dv, int(w.shape(1)), order);
             SW_CHECK(w.shape(0) == d.channels(), "conv_weight has ", w.shape(0),
                      " channels, expected 2*Hk*dk + Hv*dv = ", d.channels());
             return std::make_unique<PyGDNLayer>(d, w.data(), max_pending);
           }),
           py::arg("hk"), py::arg("hv"), py::arg("dk"), py::arg("dv"), py::arg("conv_weight"),
           py::arg("head_order") = "grouped", py::arg("max_pending") = 8)
      .def("verify", [](PyGDNLayer& L, py::handle x_obj, py::handle g_obj, py::handle b_obj,
                        py::handle parents_obj, int threads) {
             Exclusive::Use use(L.exclusive, kGdnBusy);
             const GDNDims& d = L.dims();
             std::vector<int> parents = as_ints(parents_obj, "parents");
             const int n = int(parents.size());
             check_parents(parents.data(), n);
             F32 x = as_f32(x_obj, "x", {n, d.channels()});
             F32 g = as_f32(g_obj, "g", {n, d.hv});
             F32 b = as_f32(b_obj, "beta", {n, d.hv});
             py::array_t<float> out({n, d.hv, d.dv});
             py::gil_scoped_release release;
             L.verify(x.data(), g.data(), b.data(), parents.data(), n, out.mutable_data(), threads);
             return out;
           },
           py::arg("x"), py::arg("g"), py::arg("beta"), py::arg("parents"), py::arg("threads") = 0)
      .def("prefill", [](PyGDNLayer& L, py::handle x_obj, py::handle g_obj, py::handle b_obj,
                         int threads) {
             Exclusive::Use use(L.exclusive, kGdnBusy);
             const GDNDims& d = L.dims();
             F32 x = as_f32(x_obj, "x", {-1, d.channels()});
             const int n = int(x.shape(0));
             SW_CHECK(n > 0, "prefill needs at least one token");
             F32 g = as_f32(g_obj, "g", {n, d.hv});
             F32 b = as_f32(b_obj, "beta", {n, d.hv});
             py::array_t<float> out({n, d.hv, d.dv});
             py::gil_scoped_release release;
             L.prefill(x.data(), g.data(), b.data(), n, out.mutable_data(), threads);
             return out;
           },
           py::arg("x"), py::arg("g"), py::arg("beta"), py::arg("threads") = 0)
      .def("commit", [](PyGDNLayer& L, py::handle path_obj, int threads) {
             Exclusive::Use use(L.exclusive, kGdnBusy);
             std::vector<int> path = as_ints(path_obj, "path");
             py::gil_scoped_release release;
             L.commit(path, threads);
           },
           py::arg("path"), py::arg("threads") = 0)
      .def("reset", [](PyGDNLayer& L) {
        Exclusive::Use use(L.exclusive, kGdnBusy);
        L.reset();
      })
      .def_property_readonly("n_pending", [](const PyGDNLayer& L) {
        Exclusive::Use use(L.exclusive, kGdnBusy);
        return L.n_pending();
      })
      .def("folded_state", [](const PyGDNLayer& L) {
             Exclusive::Use use(L.exclusive, kGdnBusy);
             const GDNDims& d = L.dims();
             std::vector<float> s = L.folded_state(0);
             py::array_t<float> out({d.hv, d.dk, d.dv});
             std::copy(s.begin(), s.end(), out.mutable_data());
             return out;
           })
      .def_property_readonly("window", [](const PyGDNLayer& L) {
        Exclusive::Use use(L.exclusive, kGdnBusy);
        const GDNDims& d = L.dims();
        py::array_t<float> out({d.conv_k - 1, d.channels()});
        std::copy(L.window().begin(), L.window().end(), out.mutable_data());
        return out;
      });
  bind_engine(m);
  bind_tree_growth(m);
  bind_gpu(m);
  bind_mtp(m);
  bind_backend_ops(m);
}

// SYCL host backend: launches the kernel templates of sycl/*.hpp on a SYCL 2020 device (Intel
// Arc through icpx -fsycl, or AdaptiveCpp). Built only where a SYCL compiler exists (see the
// guarded section of CMakeLists.txt); not wired into the engine yet.
//
// Two layers:
// - swsycl::Device: device-pointer (USM) entry points, one per kernel family, doing the same
//   host planning as the emulator launchers (emu/launch_*.cpp) — the engine would call these;
// - extern "C" sw_* functions with the emulator's exact signatures on host pointers (staged
//   through USM), so tests/gpu_util.py can load this library in place of an emulated one and run
//   the same oracle suite on real hardware (SAPWOOD_SYCL_LIB=path/to/libsapwood_sycl.so).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "gdn.hpp"
#include "kv_quant.hpp"
#include "q8_matmul.hpp"
#include "tree_attention.hpp"

namespace swsycl {

// Every kernel: a 1-D nd_range of `groups` work-groups of `local` items, sub-groups of 32,
// `local_bytes` of local memory handed to the body as a raw pointer.
template <class Body>
sycl::event launch(sycl::queue& q, size_t groups, size_t local, size_t local_bytes, Body body) {
  return q.submit([&](sycl::handler& h) {
    sycl::local_accessor<int8_t, 1> lm(sycl::range<1>(local_bytes ? local_bytes : 4), h);
    h.parallel_for(sycl::nd_range<1>(sycl::range<1>(groups * local), sycl::range<1>(local)),
                   [=](sycl::nd_item<1> it) [[sycl::reqd_sub_group_size(32)]] {
                     body(it, lm.get_multi_ptr<sycl::access::decorated::no>().get());
                   });
  });
}

inline int round32(int n) { return (n + 31) / 32 * 32; }

class Device {
 public:
  explicit Device(sycl::queue q) : q_(std::move(q)) {}
  sycl::queue& queue() { return q_; }

  void kv_quantize(KVQuantArgs a) {
    launch(q_, size_t(a.n_tokens) * a.n_kv_heads, a.head_dim, 0,
           [=](sycl::nd_item<1> it, int8_t*) { swsycl::kv_quantize(it, a); }).wait();
  }

  // a.anc / a.row_len / a.part are filled here (device scratch); a.q and a.out are whole arrays.
  void tree_attention(AttnArgs a, const int32_t* parents_host) {
    const int N = a.n_rows;
    std::vector<int32_t> depth(N), anc(size_t(N) * N), row_len(N);
    AttnPlan plan;
    const int max_sg = int(q_.get_device().get_info<sycl::info::device::max_work_group_size>() / 32);
    if (a.n_q_heads / a.n_kv_heads > max_sg * kAttnMaxP)
      throw std::invalid_argument("tree_attention: too many query heads per KV head");
    if (attn_plan(parents_host, N, a.hist_len, a.n_q_heads, a.n_kv_heads, imin(max_sg, 32), depth.data(),
                  anc.data(), row_len.data(), &plan))
      throw std::invalid_argument("tree_attention: bad parents");
    int32_t* anc_d = sycl::malloc_device<int32_t>(size_t(N) * plan.stride, q_);
    int32_t* len_d = sycl::malloc_device<int32_t>(N, q_);
    q_.memcpy(anc_d, anc.data(), sizeof(int32_t) * N * plan.stride);
    q_.memcpy(len_d, row_len.data(), sizeof(int32_t) * N).wait();
    a.anc_stride = plan.stride;
    a.scale = 1.0f / std::sqrt(float(a.head_dim));
    const float* q0 = a.q;
    float* out0 = a.out;
    int nr = 0, n_chunks = 0, nsg = 0;
    for (int r0 = 0; r0 < N; r0 += nr) {
      attn_block(plan, row_len.data(), r0, a.split, &nr, &n_chunks, &nsg);
      AttnArgs b = a;
      b.n_rows = nr, b.n_chunks = n_chunks;
      b.q = q0 + size_t(r0) * a.n_q_heads * a.head_dim;
      b.out = out0 + size_t(r0) * a.n_q_heads * a.head_dim;
      b.anc = anc_d + size_t(r0) * plan.stride;
      b.row_len = len_d + r0;
      b.part = sycl::malloc_device<float>(size_t(n_chunks) * nr * a.n_q_heads * (a.head_dim + 2), q_);
      launch(q_, size_t(n_chunks) * a.n_kv_heads, size_t(nsg) * 32, attn_local_bytes(a.head_dim),
             [=](sycl::nd_item<1> it, int8_t* lm) { swsycl::tree_attn_partial(it, b, lm); });
      launch(q_, size_t(nr) * a.n_q_heads, 32, 0, [=](sycl::nd_item<1> it, int8_t*) { swsycl::tree_attn_merge(it, b); })
          .wait();
      sycl::free(b.part, q_);
    }
    sycl::free(anc_d, q_);
    sycl::free(len_d, q_);
  }

  void gdn_verify(GDNArgs a) {
    const int threads = round32(imax(a.dk, a.dv));
    launch(q_, size_t(a.n_nodes) * (2 * a.hk + a.hv), 32, 0, [=](sycl::nd_item<1> it, int8_t*) { swsycl::gdn_conv(it, a); });
    launch(q_, a.hv, threads, sizeof(float) * 2 * a.dk, [=](sycl::nd_item<1> it, int8_t* lm) {
      swsycl::gdn_recur(it, a, reinterpret_cast<float*>(lm));
    }).wait();
  }

  void gdn_commit(GDNArgs a) {
    const int threads = round32(imax(a.dk, a.dv)), C = 2 * a.hk * a.dk + a.hv * a.dv;
    launch(q_, a.hv, threads, sizeof(float) * a.dk, [=](sycl::nd_item<1> it, int8_t* lm) {
      swsycl::gdn_commit(it, a, reinterpret_cast<float*>(lm));
    });
    if (a.path_len > 0)
      launch(q_, (C + kGDNWindowThreads - 1) / kGDNWindowThreads, kGDNWindowThreads, 0,
             [=](sycl::nd_item<1> it, int8_t*) { swsycl::gdn_window(it, a); });
    q_.wait();
  }

  void q8_quantize_rows(Q8Args a) {
    launch(q_, a.rows, kQ8Threads, sizeof(float) * kQ8Threads / 32, [=](sycl::nd_item<1> it, int8_t* lm) {
      swsycl::q8_quantize_rows(it, a, reinterpret_cast<float*>(lm));
    }).wait();
  }

  void q8_matmul(Q8Args a) {
    launch(q_, (a.out_features + kQ8Threads / 32 - 1) / (kQ8Threads / 32), kQ8Threads, 0,
           [=](sycl::nd_item<1> it, int8_t*) { swsycl::q8_matmul(it, a); }).wait();
  }

 private:
  sycl::queue q_;
};

}  // namespace swsycl

// ---------------- extern "C": the emulator's API on host pointers ----------------
namespace {

std::string g_error;

swsycl::Device& device() {
  static swsycl::Device d{sycl::queue{sycl::gpu_selector_v}};
  return d;
}

// A device copy of a host array; copied back on destruction when `out` is set.
template <class T> struct Staged {
  T* d = nullptr;
  T* host = nullptr;
  size_t n = 0;
  Staged(const T* h, size_t count, bool out = false) : host(out ? const_cast<T*>(h) : nullptr), n(count) {
    d = sycl::malloc_device<T>(n ? n : 1, device().queue());
    if (h && n) device().queue().memcpy(d, h, sizeof(T) * n).wait();
  }
  ~Staged() {
    if (host && n) device().queue().memcpy(host, d, sizeof(T) * n).wait();
    sycl::free(d, device().queue());
  }
};

template <class F> int guard(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

size_t pages_of(const int32_t* pt, int hist_len, int page_size) {  // pages the history spans
  int m = 0;
  for (int i = 0; page_size > 0 && i * page_size < hist_len; ++i) m = std::max(m, pt[i] + 1);
  return size_t(m);
}

}  // namespace

#define SW_API extern "C" __attribute__((visibility("default")))

SW_API const char* sw_last_error() { return g_error.c_str(); }
SW_API long sw_barrier_waits() { return -1; }  // not observable on hardware

SW_API int sw_kv_quantize(const float* x, int8_t* q, float* s, const int32_t* page_table, int T, int Hkv, int D,
                          int page_size, int pos0) {
  return guard([&] {
    const size_t rows = page_size > 0 ? pages_of(page_table, pos0 + T, page_size) * Hkv * page_size
                                      : size_t(T) * Hkv;
    const int n_pt = page_size > 0 ? (pos0 + T + page_size - 1) / page_size : 0;
    Staged<float> xd(x, size_t(T) * Hkv * D);
    Staged<int8_t> qd(q, rows * D, true);
    Staged<float> sd(s, rows * (D / 32), true);
    Staged<int32_t> ptd(page_table, n_pt);
    device().kv_quantize({xd.d, qd.d, sd.d, ptd.d, T, Hkv, D, page_size, pos0});
  });
}

SW_API int sw_tree_attention(const float* q, const int8_t* k_pages, const float* k_pscale, const int8_t* v_pages,
                             const float* v_pscale, const int32_t* page_table, const int8_t* k_tree,
                             const float* k_tscale, const int8_t* v_tree, const float* v_tscale,
                             const int32_t* parents, int N, int Hq, int Hkv, int D, int hist_len, int page_size,
                             int split, float* out) {
  return guard([&] {
    const size_t prow = pages_of(page_table, hist_len, page_size) * Hkv * page_size;
    const size_t trow = size_t(N) * Hkv;
    Staged<float> qd(q, size_t(N) * Hq * D), od(out, size_t(N) * Hq * D, true);
    Staged<int8_t> kp(k_pages, prow * D), vp(v_pages, prow * D), kt(k_tree, trow * D), vt(v_tree, trow * D);
    Staged<float> ks(k_pscale, prow * D / 32), vs(v_pscale, prow * D / 32);
    Staged<float> kts(k_tscale, trow * D / 32), vts(v_tscale, trow * D / 32);
    Staged<int32_t> pt(page_table, page_size > 0 ? (hist_len + page_size - 1) / page_size : 0);
    swsycl::AttnArgs a{qd.d, kp.d, vp.d, ks.d, vs.d, pt.d, kt.d, vt.d, kts.d, vts.d, nullptr, nullptr, nullptr,
                       od.d, N, Hq, Hkv, D, hist_len, page_size, split, 0, 0, 0.0f};
    device().tree_attention(a, parents);
  });
}

SW_API int sw_gdn_verify(const int32_t* dims, const float* x, const float* g, const float* beta,
                         const int32_t* parents, int N, const float* window, const float* conv_w,
                         const float* state, const float* tk, const float* tv, const float* tg, const float* tb,
                         int n_pending, float* q, float* k, float* v, float* out, float* node_state) {
  return guard([&] {
    const int hk = dims[0], hv = dims[1], dk = dims[2], dv = dims[3], K = dims[4];
    const size_t C = size_t(2) * hk * dk + size_t(hv) * dv, P = size_t(n_pending);
    Staged<float> xd(x, N * C), gd(g, size_t(N) * hv), bd(beta, size_t(N) * hv), wd(window, (K - 1) * C);
    Staged<float> cw(conv_w, K * C), sd(state, size_t(hv) * dk * dv);
    Staged<float> tkd(tk, P * hk * dk), tvd(tv, P * hv * dv), tgd(tg, P * hv), tbd(tb, P * hv);
    Staged<float> qd(q, size_t(N) * hk * dk, true), kd(k, size_t(N) * hk * dk, true);
    Staged<float> vd(v, size_t(N) * hv * dv, true), od(out, size_t(N) * hv * dv, true);
    Staged<float> nsd(node_state, size_t(N) * hv * dk * dv, true);
    Staged<int32_t> pd(parents, N);
    swsycl::GDNArgs a{};
    a.x = xd.d, a.window = wd.d, a.conv_w = cw.d, a.parents = pd.d, a.q = qd.d, a.k = kd.d, a.v = vd.d;
    a.g = gd.d, a.beta = bd.d, a.state = sd.d, a.tape_k = tkd.d, a.tape_v = tvd.d, a.tape_g = tgd.d;
    a.tape_b = tbd.d, a.out = od.d, a.node_state = nsd.d;
    a.n_nodes = N, a.hk = hk, a.hv = hv, a.dk = dk, a.dv = dv, a.conv_k = K, a.grouped = dims[5];
    a.n_pending = n_pending, a.q_scale = 1.0f / std::sqrt(float(dk));
    device().gdn_verify(a);
  });
}

SW_API int sw_gdn_commit(const int32_t* dims, float* state, const float* tk, const float* tv, const float* tg,
                         const float* tb, int n_pending, const float* k, const float* v, const float* g,
                         const float* beta, const int32_t* path, int path_len, const float* node_state, int n_fold,
                         int select, float* nk, float* nv, float* ng, float* nb, const float* window,
                         const float* x, float* new_window) {
  return guard([&] {
    const int hk = dims[0], hv = dims[1], dk = dims[2], dv = dims[3], K = dims[4];
    const size_t C = size_t(2) * hk * dk + size_t(hv) * dv, P = size_t(n_pending);
    int n_nodes = 0;  // the verified tree's size is not passed: the path's largest node bounds it
    for (int i = 0; i < path_len; ++i) n_nodes = std::max(n_nodes, path[i] + 1);
    const size_t NEW = P + path_len - n_fold, N = size_t(n_nodes);
    Staged<float> sd(state, size_t(hv) * dk * dv, true);
    Staged<float> tkd(tk, P * hk * dk), tvd(tv, P * hv * dv), tgd(tg, P * hv), tbd(tb, P * hv);
    Staged<float> kd(k, N * hk * dk), vd(v, N * hv * dv), gd(g, N * hv), bd(beta, N * hv);
    Staged<float> nsd(select ? node_state : nullptr, select ? N * hv * dk * dv : 0);
    Staged<float> nkd(nk, NEW * hk * dk, true), nvd(nv, NEW * hv * dv, true), ngd(ng, NEW * hv, true);
    Staged<float> nbd(nb, NEW * hv, true), wd(window, (K - 1) * C), xd(x, N * C);
    Staged<float> nwd(new_window, (K - 1) * C, true);
    Staged<int32_t> pd(path, path_len);
    swsycl::GDNArgs a{};
    a.state = sd.d, a.tape_k = tkd.d, a.tape_v = tvd.d, a.tape_g = tgd.d, a.tape_b = tbd.d;
    a.k = kd.d, a.v = vd.d, a.g = gd.d, a.beta = bd.d, a.path = pd.d, a.node_state = nsd.d;
    a.new_k = nkd.d, a.new_v = nvd.d, a.new_g = ngd.d, a.new_b = nbd.d;
    a.window = wd.d, a.x = xd.d, a.new_window = nwd.d;
    a.hk = hk, a.hv = hv, a.dk = dk, a.dv = dv, a.conv_k = K, a.grouped = dims[5];
    a.n_pending = n_pending, a.path_len = path_len, a.n_fold = n_fold, a.select_leaf = select;
    device().gdn_commit(a);
  });
}

SW_API int sw_q8_quantize_rows(const float* x, int rows, int cols, int cols_pad, int8_t* xq, float* xs) {
  return guard([&] {
    Staged<float> xd(x, size_t(rows) * cols), xsd(xs, rows, true);
    Staged<int8_t> xqd(xq, size_t(rows) * cols_pad, true);
    swsycl::Q8Args a{};
    a.x = xd.d, a.xq = xqd.d, a.xs = xsd.d, a.rows = rows, a.cols = cols, a.cols_pad = cols_pad;
    device().q8_quantize_rows(a);
  });
}

SW_API int sw_q8_matmul(const int8_t* w, const float* w_scale, const int8_t* xq, const float* xs, int rows,
                        int cols_pad, int out, float* y) {
  return guard([&] {
    Staged<int8_t> wd(w, size_t(out) * cols_pad), xqd(xq, size_t(rows) * cols_pad);
    Staged<float> wsd(w_scale, out), xsd(xs, rows), yd(y, size_t(rows) * out, true);
    swsycl::Q8Args a{};
    a.w = wd.d, a.w_scale = wsd.d, a.xq = xqd.d, a.xs = xsd.d, a.y = yd.d;
    a.rows = rows, a.cols_pad = cols_pad, a.out_features = out;
    device().q8_matmul(a);
  });
}

// Emulated launches of pathwise GDN (metal/gdn.metal or sycl/gdn.hpp). dims = {hk, hv, dk, dv,
// conv_k, grouped}. The host keeps the state, the pending tape and the window; verify writes the
// tree's tape (q, k, v), outputs and per-node states; commit selects or replays.
#include "api.hpp"
#if defined(SW_METAL)
#include "metal_shim.hpp"
#include "gdn.metal"
#else
#include "gdn.hpp"
#endif

using swemu::ThreadCtx;

namespace {
void check_dims(const int32_t* d) {
  swemu::require(d[0] > 0 && d[1] % d[0] == 0, "hv must be a multiple of hk");
  swemu::require(d[2] >= 1 && d[2] <= 128 && d[3] >= 1 && d[3] <= 256, "dk <= 128, dv <= 256");
  swemu::require(d[4] >= 2 && d[4] <= 8, "conv_k in 2..8");
}
int recur_threads(const int32_t* d) { return swemu::round32(swemu::imax(d[2], d[3])); }
}  // namespace

SW_API int sw_gdn_verify(const int32_t* dims, const float* x, const float* g, const float* beta,
                         const int32_t* parents, int N, const float* window, const float* conv_w,
                         const float* state, const float* tk, const float* tv, const float* tg,
                         const float* tb, int n_pending, float* q, float* k, float* v, float* out,
                         float* node_state) {
  return swemu::guard([&] {
    check_dims(dims);
    for (int i = 0; i < N; ++i)
      swemu::require(i == 0 ? parents[0] == -1 : (parents[i] >= 0 && parents[i] < i), "parents");
    const int hk = dims[0], hv = dims[1], dk = dims[2], dv = dims[3], K = dims[4], grouped = dims[5];
    const float q_scale = 1.0f / __builtin_sqrtf(float(dk));
    const size_t kq_bytes = sizeof(float) * 2 * dk;
#if defined(SW_METAL)
    SwGDNParams p{N, hk, hv, dk, dv, K, grouped, n_pending, 0, 0, 0, q_scale};
    const uint32_t g1[3] = {uint32_t(N), uint32_t(2 * hk + hv), 1};
    swemu::runner().launch(g1, 32, 0, [&](const ThreadCtx& c) {
      gdn_conv(x, parents, window, conv_w, q, k, v, p, uint3(c.tg[0], c.tg[1], c.tg[2]), c.lane);
    });
    const uint32_t g2[3] = {uint32_t(hv), 1, 1};
    swemu::runner().launch(g2, recur_threads(dims), kq_bytes, [&](const ThreadCtx& c) {
      gdn_recur(state, tk, tv, tg, tb, q, k, v, g, beta, parents, out, node_state, p,
                reinterpret_cast<float*>(c.smem), uint3(c.tg[0], c.tg[1], c.tg[2]), c.tid);
    });
#else
    swsycl::GDNArgs a{};
    a.x = x, a.window = window, a.conv_w = conv_w, a.parents = parents, a.q = q, a.k = k, a.v = v;
    a.g = g, a.beta = beta, a.state = const_cast<float*>(state);
    a.tape_k = tk, a.tape_v = tv, a.tape_g = tg, a.tape_b = tb, a.out = out, a.node_state = node_state;
    a.n_nodes = N, a.hk = hk, a.hv = hv, a.dk = dk, a.dv = dv, a.conv_k = K, a.grouped = grouped;
    a.n_pending = n_pending, a.q_scale = q_scale;
    const uint32_t g1[3] = {uint32_t(N * (2 * hk + hv)), 1, 1};
    swemu::runner().launch(g1, 32, 0, [&](const ThreadCtx& c) { swsycl::gdn_conv(swemu::NdItem{&c}, a); });
    const uint32_t g2[3] = {uint32_t(hv), 1, 1};
    swemu::runner().launch(g2, recur_threads(dims), kq_bytes, [&](const ThreadCtx& c) {
      swsycl::gdn_recur(swemu::NdItem{&c}, a, reinterpret_cast<float*>(c.smem));
    });
#endif
  });
}

// Commit path [path_len] of the last verify: select (state = node_state[leaf], nothing pending)
// or replay (fold the first n_fold tokens of pending ++ path; the rest becomes the new tape).
// The window update runs in both modes.
SW_API int sw_gdn_commit(const int32_t* dims, float* state, const float* tk, const float* tv, const float* tg,
                         const float* tb, int n_pending, const float* k, const float* v, const float* g,
                         const float* beta, const int32_t* path, int path_len, const float* node_state,
                         int n_fold, int select, float* nk, float* nv, float* ng, float* nb,
                         const float* window, const float* x, float* new_window) {
  return swemu::guard([&] {
    check_dims(dims);
    swemu::require(n_fold >= 0 && n_fold <= n_pending + path_len, "n_fold");
    swemu::require(!select || path_len >= 1, "select needs a path");
    const int hk = dims[0], hv = dims[1], dk = dims[2], dv = dims[3], K = dims[4], grouped = dims[5];
    const int C = 2 * hk * dk + hv * dv;
    const uint32_t g1[3] = {uint32_t(hv), 1, 1};
    const uint32_t g2[3] = {uint32_t((C + 255) / 256), 1, 1};
#if defined(SW_METAL)
    SwGDNParams p{0, hk, hv, dk, dv, K, grouped, n_pending, path_len, n_fold, select, 0.0f};
    swemu::runner().launch(g1, recur_threads(dims), sizeof(float) * dk, [&](const ThreadCtx& c) {
      gdn_commit(state, tk, tv, tg, tb, k, v, g, beta, path, node_state, nk, nv, ng, nb, p,
                 reinterpret_cast<float*>(c.smem), uint3(c.tg[0], c.tg[1], c.tg[2]), c.tid);
    });
    if (path_len > 0)
      swemu::runner().launch(g2, SW_GDN_THREADS_W, 0, [&](const ThreadCtx& c) {
        gdn_window(window, x, path, new_window, p, uint3(c.tg[0], c.tg[1], c.tg[2]), c.tid);
      });
#else
    swsycl::GDNArgs a{};
    a.state = state, a.tape_k = tk, a.tape_v = tv, a.tape_g = tg, a.tape_b = tb;
    a.k = const_cast<float*>(k), a.v = const_cast<float*>(v), a.g = g, a.beta = beta, a.path = path;
    a.node_state = const_cast<float*>(node_state), a.new_k = nk, a.new_v = nv, a.new_g = ng, a.new_b = nb;
    a.window = window, a.x = x, a.new_window = new_window;
    a.hk = hk, a.hv = hv, a.dk = dk, a.dv = dv, a.conv_k = K, a.grouped = grouped;
    a.n_pending = n_pending, a.path_len = path_len, a.n_fold = n_fold, a.select_leaf = select;
    swemu::runner().launch(g1, recur_threads(dims), sizeof(float) * dk, [&](const ThreadCtx& c) {
      swsycl::gdn_commit(swemu::NdItem{&c}, a, reinterpret_cast<float*>(c.smem));
    });
    if (path_len > 0)
      swemu::runner().launch(g2, swsycl::kGDNWindowThreads, 0, [&](const ThreadCtx& c) {
        swsycl::gdn_window(swemu::NdItem{&c}, a);
      });
#endif
  });
}

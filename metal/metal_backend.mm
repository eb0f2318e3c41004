// Metal host backend (Objective-C++, macOS only; see the guarded section of CMakeLists.txt).
// Loads sapwood.metallib (the .metal files compiled offline with fast math off), builds one
// pipeline per kernel, and exposes the emulator's extern "C" API (emu/launch_*.cpp) on host
// pointers, so tests/gpu_util.py can run the same oracle suite against the real GPU
// (SAPWOOD_METAL_LIB=path/to/libsapwood_metal.dylib). Not wired into the engine yet.
//
// Buffers are shared-storage copies of the host arrays (unified memory on Apple silicon; the
// copies keep this layer simple and are not what an engine integration would do). The
// planning is metal/sw_plan.h, the same code the emulator launcher runs.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "sw_common.h"
#include "sw_plan.h"

namespace {

std::string g_error;

// $SAPWOOD_METALLIB, else sapwood.metallib next to this library (where CMake installs it), else
// the build tree's copy.
std::string metallib_path() {
  if (const char* env = std::getenv("SAPWOOD_METALLIB")) return env;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&metallib_path), &info) && info.dli_fname) {
    std::string dir(info.dli_fname);
    dir = dir.substr(0, dir.find_last_of('/') + 1);
    if (FILE* f = std::fopen((dir + "sapwood.metallib").c_str(), "rb")) {
      std::fclose(f);
      return dir + "sapwood.metallib";
    }
  }
  return SAPWOOD_METALLIB_PATH;
}

class MetalDevice {
 public:
  MetalDevice() {
    dev_ = MTLCreateSystemDefaultDevice();
    if (!dev_) throw std::runtime_error("no Metal device");
    queue_ = [dev_ newCommandQueue];
    NSString* path = [NSString stringWithUTF8String:metallib_path().c_str()];
    NSError* err = nil;
    lib_ = [dev_ newLibraryWithURL:[NSURL fileURLWithPath:path] error:&err];
    if (!lib_) throw std::runtime_error(std::string("cannot load ") + path.UTF8String);
  }

  id<MTLComputePipelineState> pipeline(const char* name) {
    NSString* key = [NSString stringWithUTF8String:name];
    id<MTLComputePipelineState> p = pipes_[key];
    if (p) return p;
    id<MTLFunction> f = [lib_ newFunctionWithName:key];
    if (!f) throw std::runtime_error(std::string("no kernel ") + name);
    NSError* err = nil;
    p = [dev_ newComputePipelineStateWithFunction:f error:&err];
    if (!p) throw std::runtime_error(std::string("pipeline ") + name + ": " + err.localizedDescription.UTF8String);
    if (p.threadExecutionWidth != SW_SIMD)  // the kernels' canonical order assumes 32 lanes
      throw std::runtime_error(std::string(name) + ": simdgroup width is not 32");
    if (!pipes_) pipes_ = [NSMutableDictionary dictionary];
    pipes_[key] = p;
    return p;
  }

  // A shared buffer holding a copy of host memory (or zeros when host is null).
  id<MTLBuffer> buffer(const void* host, size_t bytes) {
    bytes = bytes ? bytes : 16;
    return host ? [dev_ newBufferWithBytes:host length:bytes options:MTLResourceStorageModeShared]
                : [dev_ newBufferWithLength:bytes options:MTLResourceStorageModeShared];
  }

  // Encode one dispatch: buffers at indices 0.., the parameter block as bytes at `pidx`.
  template <class P>
  void dispatch(id<MTLCommandBuffer> cb, const char* name, std::initializer_list<id<MTLBuffer>> bufs,
                const P& params, int pidx, MTLSize groups, int threads, size_t tg_bytes) {
    id<MTLComputePipelineState> p = pipeline(name);
    if (threads > int(p.maxTotalThreadsPerThreadgroup))
      throw std::runtime_error(std::string(name) + ": threadgroup too large for this pipeline");
    id<MTLComputeCommandEncoder> enc = [cb computeCommandEncoder];
    [enc setComputePipelineState:p];
    int i = 0;
    for (id<MTLBuffer> b : bufs) [enc setBuffer:b offset:0 atIndex:i++];
    [enc setBytes:&params length:sizeof(P) atIndex:pidx];
    if (tg_bytes) [enc setThreadgroupMemoryLength:(tg_bytes + 15) / 16 * 16 atIndex:0];
    [enc dispatchThreadgroups:groups threadsPerThreadgroup:MTLSizeMake(threads, 1, 1)];
    [enc endEncoding];
  }

  id<MTLCommandBuffer> begin() { return [queue_ commandBuffer]; }
  static void finish(id<MTLCommandBuffer> cb) {
    [cb commit];
    [cb waitUntilCompleted];
    if (cb.error) throw std::runtime_error(cb.error.localizedDescription.UTF8String);
  }
  int max_simdgroups(const char* name) { return int(pipeline(name).maxTotalThreadsPerThreadgroup) / SW_SIMD; }

 private:
  id<MTLDevice> dev_;
  id<MTLCommandQueue> queue_;
  id<MTLLibrary> lib_;
  NSMutableDictionary<NSString*, id<MTLComputePipelineState>>* pipes_ = nil;
};

MetalDevice& device() {
  static MetalDevice d;
  return d;
}

void copy_out(id<MTLBuffer> b, void* host, size_t bytes) {
  if (host && bytes) memcpy(host, b.contents, bytes);
}

template <class F> int guard(F&& f) {
  @autoreleasepool {
    try {
      f();
      return 0;
    } catch (const std::exception& e) {
      g_error = e.what();
      return -1;
    }
  }
}

size_t pages_of(const int32_t* pt, int positions, int page_size) {
  int m = 0;
  for (int i = 0; page_size > 0 && i * page_size < positions; ++i) m = std::max(m, pt[i] + 1);
  return size_t(m);
}

}  // namespace

#define SW_API extern "C" __attribute__((visibility("default")))

SW_API const char* sw_last_error() { return g_error.c_str(); }
SW_API long sw_barrier_waits() { return -1; }  // not observable on hardware

SW_API int sw_kv_quantize(const float* x, int8_t* q, float* s, const int32_t* page_table, int T, int Hkv, int D,
                          int page_size, int pos0) {
  return guard([&] {
    MetalDevice& d = device();
    const size_t rows = page_size > 0 ? pages_of(page_table, pos0 + T, page_size) * Hkv * page_size : size_t(T) * Hkv;
    const int n_pt = page_size > 0 ? (pos0 + T + page_size - 1) / page_size : 1;
    id<MTLBuffer> xb = d.buffer(x, sizeof(float) * T * Hkv * D), qb = d.buffer(q, rows * D);
    id<MTLBuffer> sb = d.buffer(s, sizeof(float) * rows * D / 32);
    id<MTLBuffer> pb = d.buffer(page_size > 0 ? page_table : nullptr, sizeof(int32_t) * n_pt);
    SwKVQuantParams p{T, Hkv, D, page_size, pos0};
    id<MTLCommandBuffer> cb = d.begin();
    d.dispatch(cb, "kv_quantize", {xb, qb, sb, pb}, p, 4, MTLSizeMake(T, Hkv, 1), D, 0);
    MetalDevice::finish(cb);
    copy_out(qb, q, rows * D);
    copy_out(sb, s, sizeof(float) * rows * D / 32);
  });
}

SW_API int sw_tree_attention(const float* q, const int8_t* k_pages, const float* k_pscale, const int8_t* v_pages,
                             const float* v_pscale, const int32_t* page_table, const int8_t* k_tree,
                             const float* k_tscale, const int8_t* v_tree, const float* v_tscale,
                             const int32_t* parents, int N, int Hq, int Hkv, int D, int hist_len, int page_size,
                             int split, float* out) {
  return guard([&] {
    MetalDevice& d = device();
    if (D % 32 || D > SW_MAX_HEAD_DIM || split % SW_ATTN_TILE || (hist_len && page_size % SW_ATTN_TILE))
      throw std::invalid_argument("tree_attention: unsupported shape");
    const int max_sg = std::min(32, d.max_simdgroups("tree_attn_partial"));
    if (Hq / Hkv > max_sg * SW_ATTN_MAXP) throw std::invalid_argument("too many query heads per KV head");
    std::vector<int32_t> depth(N), anc(size_t(N) * N), row_len(N);
    SwAttnPlan plan;
    if (sw_attn_plan(parents, N, hist_len, Hq, Hkv, max_sg, depth.data(), anc.data(), row_len.data(), &plan))
      throw std::invalid_argument("tree_attention: bad parents");
    const size_t prow = pages_of(page_table, hist_len, page_size) * Hkv * page_size, trow = size_t(N) * Hkv;
    id<MTLBuffer> kp = d.buffer(k_pages, prow * D), vp = d.buffer(v_pages, prow * D);
    id<MTLBuffer> ks = d.buffer(k_pscale, sizeof(float) * prow * D / 32), vs = d.buffer(v_pscale, sizeof(float) * prow * D / 32);
    const int n_pt = hist_len > 0 ? (hist_len + page_size - 1) / page_size : 1;
    id<MTLBuffer> pt = d.buffer(hist_len ? page_table : nullptr, sizeof(int32_t) * n_pt);
    id<MTLBuffer> kt = d.buffer(k_tree, trow * D), vt = d.buffer(v_tree, trow * D);
    id<MTLBuffer> kts = d.buffer(k_tscale, sizeof(float) * trow * D / 32), vts = d.buffer(v_tscale, sizeof(float) * trow * D / 32);
    const float scale = 1.0f / std::sqrt(float(D));
    int nr = 0, n_chunks = 0, nsg = 0;
    for (int r0 = 0; r0 < N; r0 += nr) {
      sw_attn_block(plan, row_len.data(), r0, split, &nr, &n_chunks, &nsg);
      id<MTLBuffer> qb = d.buffer(q + size_t(r0) * Hq * D, sizeof(float) * nr * Hq * D);
      id<MTLBuffer> ab = d.buffer(anc.data() + size_t(r0) * plan.stride, sizeof(int32_t) * nr * plan.stride);
      id<MTLBuffer> lb = d.buffer(row_len.data() + r0, sizeof(int32_t) * nr);
      id<MTLBuffer> part = d.buffer(nullptr, sizeof(float) * n_chunks * nr * Hq * (D + 2));
      id<MTLBuffer> ob = d.buffer(nullptr, sizeof(float) * nr * Hq * D);
      SwAttnParams p{nr, Hq, Hkv, D, hist_len, page_size, split, n_chunks, plan.stride, scale};
      id<MTLCommandBuffer> cb = d.begin();
      d.dispatch(cb, "tree_attn_partial", {qb, kp, ks, vp, vs, pt, kt, kts, vt, vts, ab, lb, part}, p, 13,
                 MTLSizeMake(n_chunks, Hkv, 1), nsg * SW_SIMD, sw_attn_smem_bytes(D));
      d.dispatch(cb, "tree_attn_merge", {part, lb, ob}, p, 3, MTLSizeMake(nr, Hq, 1), SW_SIMD, 0);
      MetalDevice::finish(cb);
      copy_out(ob, out + size_t(r0) * Hq * D, sizeof(float) * nr * Hq * D);
    }
  });
}

SW_API int sw_gdn_verify(const int32_t* dims, const float* x, const float* g, const float* beta,
                         const int32_t* parents, int N, const float* window, const float* conv_w,
                         const float* state, const float* tk, const float* tv, const float* tg, const float* tb,
                         int n_pending, float* q, float* k, float* v, float* out, float* node_state) {
  return guard([&] {
    MetalDevice& d = device();
    const int hk = dims[0], hv = dims[1], dk = dims[2], dv = dims[3], K = dims[4];
    const size_t C = size_t(2) * hk * dk + size_t(hv) * dv, P = n_pending, F = sizeof(float);
    id<MTLBuffer> xb = d.buffer(x, F * N * C), pb = d.buffer(parents, sizeof(int32_t) * N);
    id<MTLBuffer> wb = d.buffer(window, F * (K - 1) * C), cw = d.buffer(conv_w, F * K * C);
    id<MTLBuffer> qb = d.buffer(nullptr, F * N * hk * dk), kb = d.buffer(nullptr, F * N * hk * dk);
    id<MTLBuffer> vb = d.buffer(nullptr, F * N * hv * dv), ob = d.buffer(nullptr, F * N * hv * dv);
    id<MTLBuffer> sb = d.buffer(state, F * hv * dk * dv), nsb = d.buffer(nullptr, F * N * hv * dk * dv);
    id<MTLBuffer> tkb = d.buffer(P ? tk : nullptr, F * P * hk * dk), tvb = d.buffer(P ? tv : nullptr, F * P * hv * dv);
    id<MTLBuffer> tgb = d.buffer(P ? tg : nullptr, F * P * hv), tbb = d.buffer(P ? tb : nullptr, F * P * hv);
    id<MTLBuffer> gb = d.buffer(g, F * N * hv), bb = d.buffer(beta, F * N * hv);
    SwGDNParams p{N, hk, hv, dk, dv, K, dims[5], n_pending, 0, 0, 0, 1.0f / std::sqrt(float(dk))};
    id<MTLCommandBuffer> cb = d.begin();
    d.dispatch(cb, "gdn_conv", {xb, pb, wb, cw, qb, kb, vb}, p, 7, MTLSizeMake(N, 2 * hk + hv, 1), SW_SIMD, 0);
    d.dispatch(cb, "gdn_recur", {sb, tkb, tvb, tgb, tbb, qb, kb, vb, gb, bb, pb, ob, nsb}, p, 13,
               MTLSizeMake(hv, 1, 1), (std::max(dk, dv) + 31) / 32 * 32, F * 2 * dk);
    MetalDevice::finish(cb);
    copy_out(qb, q, F * N * hk * dk);
    copy_out(kb, k, F * N * hk * dk);
    copy_out(vb, v, F * N * hv * dv);
    copy_out(ob, out, F * N * hv * dv);
    copy_out(nsb, node_state, F * N * hv * dk * dv);
  });
}

SW_API int sw_gdn_commit(const int32_t* dims, float* state, const float* tk, const float* tv, const float* tg,
                         const float* tb, int n_pending, const float* k, const float* v, const float* g,
                         const float* beta, const int32_t* path, int path_len, const float* node_state, int n_fold,
                         int select, float* nk, float* nv, float* ng, float* nb, const float* window,
                         const float* x, float* new_window) {
  return guard([&] {
    MetalDevice& d = device();
    const int hk = dims[0], hv = dims[1], dk = dims[2], dv = dims[3], K = dims[4];
    const size_t C = size_t(2) * hk * dk + size_t(hv) * dv, P = n_pending, F = sizeof(float);
    int n_nodes = 0;  // the verified tree's size is not passed: the path's largest node bounds it
    for (int i = 0; i < path_len; ++i) n_nodes = std::max(n_nodes, path[i] + 1);
    const size_t N = n_nodes, NEW = P + path_len - n_fold;
    id<MTLBuffer> sb = d.buffer(state, F * hv * dk * dv);
    id<MTLBuffer> tkb = d.buffer(P ? tk : nullptr, F * P * hk * dk), tvb = d.buffer(P ? tv : nullptr, F * P * hv * dv);
    id<MTLBuffer> tgb = d.buffer(P ? tg : nullptr, F * P * hv), tbb = d.buffer(P ? tb : nullptr, F * P * hv);
    id<MTLBuffer> kb = d.buffer(N ? k : nullptr, F * N * hk * dk), vb = d.buffer(N ? v : nullptr, F * N * hv * dv);
    id<MTLBuffer> gb = d.buffer(N ? g : nullptr, F * N * hv), bb = d.buffer(N ? beta : nullptr, F * N * hv);
    id<MTLBuffer> pb = d.buffer(path_len ? path : nullptr, sizeof(int32_t) * path_len);
    id<MTLBuffer> nsb = d.buffer(select ? node_state : nullptr, select ? F * N * hv * dk * dv : 16);
    id<MTLBuffer> nkb = d.buffer(nullptr, F * NEW * hk * dk), nvb = d.buffer(nullptr, F * NEW * hv * dv);
    id<MTLBuffer> ngb = d.buffer(nullptr, F * NEW * hv), nbb = d.buffer(nullptr, F * NEW * hv);
    id<MTLBuffer> wb = d.buffer(window, F * (K - 1) * C), xb = d.buffer(N ? x : nullptr, F * N * C);
    id<MTLBuffer> nwb = d.buffer(window, F * (K - 1) * C);
    SwGDNParams p{0, hk, hv, dk, dv, K, dims[5], n_pending, path_len, n_fold, select, 0.0f};
    id<MTLCommandBuffer> cb = d.begin();
    d.dispatch(cb, "gdn_commit", {sb, tkb, tvb, tgb, tbb, kb, vb, gb, bb, pb, nsb, nkb, nvb, ngb, nbb}, p, 15,
               MTLSizeMake(hv, 1, 1), (std::max(dk, dv) + 31) / 32 * 32, F * dk);
    if (path_len > 0)
      d.dispatch(cb, "gdn_window", {wb, xb, pb, nwb}, p, 4,
                 MTLSizeMake((C + SW_GDN_THREADS_W - 1) / SW_GDN_THREADS_W, 1, 1), SW_GDN_THREADS_W, 0);
    MetalDevice::finish(cb);
    copy_out(sb, state, F * hv * dk * dv);
    copy_out(nkb, nk, F * NEW * hk * dk);
    copy_out(nvb, nv, F * NEW * hv * dv);
    copy_out(ngb, ng, F * NEW * hv);
    copy_out(nbb, nb, F * NEW * hv);
    copy_out(nwb, new_window, F * (K - 1) * C);
  });
}

SW_API int sw_q8_quantize_rows(const float* x, int rows, int cols, int cols_pad, int8_t* xq, float* xs) {
  return guard([&] {
    MetalDevice& d = device();
    id<MTLBuffer> xb = d.buffer(x, sizeof(float) * rows * cols), qb = d.buffer(nullptr, size_t(rows) * cols_pad);
    id<MTLBuffer> sb = d.buffer(nullptr, sizeof(float) * rows);
    SwQ8Params p{rows, cols, cols_pad, 0};
    id<MTLCommandBuffer> cb = d.begin();
    d.dispatch(cb, "q8_quantize_rows", {xb, qb, sb}, p, 3, MTLSizeMake(rows, 1, 1), SW_Q8_THREADS,
               sizeof(float) * SW_Q8_THREADS / SW_SIMD);
    MetalDevice::finish(cb);
    copy_out(qb, xq, size_t(rows) * cols_pad);
    copy_out(sb, xs, sizeof(float) * rows);
  });
}

SW_API int sw_q8_matmul(const int8_t* w, const float* w_scale, const int8_t* xq, const float* xs, int rows,
                        int cols_pad, int out, float* y) {
  return guard([&] {
    MetalDevice& d = device();
    id<MTLBuffer> wb = d.buffer(w, size_t(out) * cols_pad), wsb = d.buffer(w_scale, sizeof(float) * out);
    id<MTLBuffer> xb = d.buffer(xq, size_t(rows) * cols_pad), xsb = d.buffer(xs, sizeof(float) * rows);
    id<MTLBuffer> yb = d.buffer(nullptr, sizeof(float) * rows * out);
    SwQ8Params p{rows, 0, cols_pad, out};
    const int per_tg = SW_Q8_THREADS / SW_SIMD;
    id<MTLCommandBuffer> cb = d.begin();
    d.dispatch(cb, "q8_matmul", {wb, wsb, xb, xsb, yb}, p, 5, MTLSizeMake((out + per_tg - 1) / per_tg, 1, 1),
               SW_Q8_THREADS, 0);
    MetalDevice::finish(cb);
    copy_out(yb, y, sizeof(float) * rows * out);
  });
}

// The SYCL kernels behind the Metal ABI of csrc/gpu/device.h: every pipeline is a Metal kernel
// name, args[i] is that kernel's [[buffer(i)]] (a buffer, or a constant block holding one of the
// parameter structs of metal/sw_common.h), Launch is the Metal grid, threads per threadgroup and
// [[threadgroup(i)]] sizes. Each op below binds the buffers into the SYCL kernel's argument
// struct and turns the Metal launch into a 1-D nd_range:
//
//   work-group size      = Launch::threads (sub-groups of 32, so Metal's simdgroups are the
//                          sub-groups one for one: simdgroup s = sub-group s);
//   work-groups          = groups[0] for the Metal kernels that read only tg.x (the others must
//                          be 1); for the 2-D ones, X * Y flattened the way the SYCL kernel
//                          decodes it, which needs one grid extent to equal a parameter (below);
//   local memory         = the [[threadgroup(i)]] sizes, each rounded to 16 bytes (Metal's
//                          granule), in one allocation.
//
//   kernel             Metal grid           SYCL group g decodes as            requires
//   kv_quantize        (tokens, Hkv)        t = g / Hkv, h = g % Hkv           Y = n_kv_heads
//   tree_attn_partial  (n_chunks, Hkv)      c = g % n_chunks, h = g / n_chunks X = n_chunks
//   tree_attn_merge    (rows, Hq)           i = g / Hq, h = g % Hq             Y = n_q_heads
//   gdn_conv           (nodes, 2hk + hv)    i = g / U, u = g % U               Y = 2 hk + hv
//
// So the GPU backend's launches need nothing SYCL-specific. Shared by the emulated device
// (emu/sycl_device.cpp) and the real one (sycl/sycl_device.cpp) through a launcher L with
// `void launch(size_t groups, int threads, size_t local_bytes, Body body)`, body(item, int8_t*
// local memory).
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

#include "elementwise.hpp"
#include "gdn.hpp"
#include "gpu/device.h"
#include "kv_quant.hpp"
#include "matmul.hpp"
#include "q8_matmul.hpp"
#include "rows.hpp"
#include "sw_common.h"  // metal/: the parameter blocks the backend binds
#include "tree_attention.hpp"

namespace swsycl {

constexpr int kMaxBuffers = 16, kMaxLocal = 2;

// One dispatch: buffer addresses by Metal index, the launch, the local memory layout.
struct Call {
  const char* name;
  void* buf[kMaxBuffers];
  const sapwood::gpu::Launch* l;
  size_t local_off[kMaxLocal];
  size_t local_bytes;

  template <class T> T* b(int i) const { return static_cast<T*>(buf[i]); }
  template <class P> const P& prm(int i) const { return *static_cast<const P*>(buf[i]); }
  [[noreturn]] void fail(const std::string& what) const { throw std::runtime_error(std::string(name) + ": " + what); }
  std::string grid() const {
    return "(" + std::to_string(l->groups[0]) + ", " + std::to_string(l->groups[1]) + ", " + std::to_string(l->groups[2]) + ")";
  }
  size_t groups_1d() const {
    if (l->groups[1] != 1 || l->groups[2] != 1) fail("the SYCL twin takes a 1-D grid (x, 1, 1), got " + grid());
    return l->groups[0];
  }
  // X * Y work-groups, where extent `dim` (0: X, 1: Y) must be `want` (the parameter `what`).
  size_t groups_2d(int dim, int want, const char* what) const {
    if (l->groups[2] != 1 || int64_t(l->groups[dim]) != want)
      fail(std::string("the SYCL twin decodes the flattened grid with ") + what + " = " + std::to_string(want) +
           ", so the grid must be " + (dim ? "(x, " : "(") + std::to_string(want) + (dim ? ", 1)" : ", y, 1)") +
           ", got " + grid());
    return size_t(l->groups[0]) * l->groups[1];
  }
  int threads() const { return l->threads; }
};

// ---- the existing families ----

template <class L> void op_kv_quantize(L& run, const Call& c) {
  const SwKVQuantParams& p = c.prm<SwKVQuantParams>(4);
  const KVQuantArgs a{c.b<const float>(0), c.b<int8_t>(1), c.b<float>(2), c.b<const int32_t>(3),
                      p.n_tokens, p.n_kv_heads, p.head_dim, p.page_size, p.pos0};
  run.launch(c.groups_2d(1, p.n_kv_heads, "n_kv_heads"), c.threads(), 0,
             [=](const auto& it, int8_t*) { kv_quantize(it, a); });
}

inline AttnArgs attn_args(const SwAttnParams& p) {
  AttnArgs a{};
  a.n_rows = p.n_rows, a.n_q_heads = p.n_q_heads, a.n_kv_heads = p.n_kv_heads, a.head_dim = p.head_dim;
  a.hist_len = p.hist_len, a.page_size = p.page_size, a.split = p.split, a.n_chunks = p.n_chunks;
  a.anc_stride = p.anc_stride, a.scale = p.scale;
  return a;
}

template <class L> void op_tree_attn_partial(L& run, const Call& c) {
  AttnArgs a = attn_args(c.prm<SwAttnParams>(13));
  a.q = c.b<const float>(0), a.k_pages = c.b<const int8_t>(1), a.k_pscale = c.b<const float>(2);
  a.v_pages = c.b<const int8_t>(3), a.v_pscale = c.b<const float>(4), a.page_table = c.b<const int32_t>(5);
  a.k_tree = c.b<const int8_t>(6), a.k_tscale = c.b<const float>(7), a.v_tree = c.b<const int8_t>(8);
  a.v_tscale = c.b<const float>(9), a.anc = c.b<const int32_t>(10), a.row_len = c.b<const int32_t>(11);
  a.part = c.b<float>(12);
  run.launch(c.groups_2d(0, a.n_chunks, "n_chunks"), c.threads(), c.local_bytes,
             [=](const auto& it, int8_t* lm) { tree_attn_partial(it, a, lm); });
}

template <class L> void op_tree_attn_merge(L& run, const Call& c) {
  AttnArgs a = attn_args(c.prm<SwAttnParams>(3));
  a.part = c.b<float>(0), a.row_len = c.b<const int32_t>(1), a.out = c.b<float>(2);
  run.launch(c.groups_2d(1, a.n_q_heads, "n_q_heads"), c.threads(), 0,
             [=](const auto& it, int8_t*) { tree_attn_merge(it, a); });
}

inline GDNArgs gdn_args(const SwGDNParams& p) {
  GDNArgs a{};
  a.n_nodes = p.n_nodes, a.hk = p.hk, a.hv = p.hv, a.dk = p.dk, a.dv = p.dv, a.conv_k = p.conv_k;
  a.grouped = p.grouped, a.n_pending = p.n_pending, a.path_len = p.path_len, a.n_fold = p.n_fold;
  a.select_leaf = p.select_leaf, a.q_scale = p.q_scale, a.last_state_only = p.last_state_only;
  return a;
}

template <class L> void op_gdn_conv(L& run, const Call& c) {
  GDNArgs a = gdn_args(c.prm<SwGDNParams>(7));
  a.x = c.b<const float>(0), a.parents = c.b<const int32_t>(1), a.window = c.b<const float>(2);
  a.conv_w = c.b<const float>(3), a.q = c.b<float>(4), a.k = c.b<float>(5), a.v = c.b<float>(6);
  run.launch(c.groups_2d(1, 2 * a.hk + a.hv, "2 hk + hv"), c.threads(), 0,
             [=](const auto& it, int8_t*) { gdn_conv(it, a); });
}

template <class L> void op_gdn_recur(L& run, const Call& c) {
  GDNArgs a = gdn_args(c.prm<SwGDNParams>(13));
  a.state = c.b<float>(0), a.tape_k = c.b<const float>(1), a.tape_v = c.b<const float>(2);
  a.tape_g = c.b<const float>(3), a.tape_b = c.b<const float>(4), a.q = c.b<float>(5), a.k = c.b<float>(6);
  a.v = c.b<float>(7), a.g = c.b<const float>(8), a.beta = c.b<const float>(9), a.parents = c.b<const int32_t>(10);
  a.out = c.b<float>(11), a.node_state = c.b<float>(12);
  run.launch(c.groups_1d(), c.threads(), c.local_bytes,
             [=](const auto& it, int8_t* lm) { gdn_recur(it, a, reinterpret_cast<float*>(lm)); });
}

template <class L> void op_gdn_commit(L& run, const Call& c) {
  GDNArgs a = gdn_args(c.prm<SwGDNParams>(15));
  a.state = c.b<float>(0), a.tape_k = c.b<const float>(1), a.tape_v = c.b<const float>(2);
  a.tape_g = c.b<const float>(3), a.tape_b = c.b<const float>(4), a.k = c.b<float>(5), a.v = c.b<float>(6);
  a.g = c.b<const float>(7), a.beta = c.b<const float>(8), a.path = c.b<const int32_t>(9);
  a.node_state = c.b<float>(10), a.new_k = c.b<float>(11), a.new_v = c.b<float>(12);
  a.new_g = c.b<float>(13), a.new_b = c.b<float>(14);
  run.launch(c.groups_1d(), c.threads(), c.local_bytes,
             [=](const auto& it, int8_t* lm) { gdn_commit(it, a, reinterpret_cast<float*>(lm)); });
}

template <class L> void op_gdn_window(L& run, const Call& c) {
  GDNArgs a = gdn_args(c.prm<SwGDNParams>(4));
  a.window = c.b<const float>(0), a.x = c.b<const float>(1), a.path = c.b<const int32_t>(2);
  a.new_window = c.b<float>(3);
  run.launch(c.groups_1d(), c.threads(), 0, [=](const auto& it, int8_t*) { gdn_window(it, a); });
}

template <class L> void op_q8_quantize_rows(L& run, const Call& c) {
  const SwQ8Params& p = c.prm<SwQ8Params>(3);
  Q8Args a{};
  a.x = c.b<const float>(0), a.xq = c.b<int8_t>(1), a.xs = c.b<float>(2);
  a.rows = p.rows, a.cols = p.cols, a.cols_pad = p.cols_pad, a.out_features = p.out_features;
  run.launch(c.groups_1d(), c.threads(), c.local_bytes,
             [=](const auto& it, int8_t* lm) { q8_quantize_rows(it, a, reinterpret_cast<float*>(lm)); });
}

template <class L> void op_q8_matmul(L& run, const Call& c) {
  const SwQ8Params& p = c.prm<SwQ8Params>(5);
  Q8Args a{};
  a.w = c.b<const int8_t>(0), a.w_scale = c.b<const float>(1), a.xq = c.b<int8_t>(2), a.xs = c.b<float>(3);
  a.y = c.b<float>(4), a.rows = p.rows, a.cols = p.cols, a.cols_pad = p.cols_pad, a.out_features = p.out_features;
  run.launch(c.groups_1d(), c.threads(), 0, [=](const auto& it, int8_t*) { q8_matmul(it, a); });
}

template <class L> void op_q4_matmul(L& run, const Call& c) {
  const SwQ4Params& p = c.prm<SwQ4Params>(6);
  const Q4Args a{c.b<const uint8_t>(0), c.b<const float>(1), c.b<const float>(2), c.b<const int8_t>(3),
                 c.b<const float>(4), c.b<float>(5), p.rows, p.cols_pad, p.out_features, p.group, p.affine};
  run.launch(c.groups_1d(), c.threads(), 0, [=](const auto& it, int8_t*) { q4_matmul(it, a); });
}

// ---- matmul.metal ----

template <class L, int kBf16> void op_matmul(L& run, const Call& c) {
  const SwQ8Params& p = c.prm<SwQ8Params>(3);
  const MatmulArgs a{c.b<const void>(0), c.b<const float>(1), c.b<float>(2), p.rows, p.cols, p.out_features};
  run.launch(c.groups_1d(), c.threads(), 0, [=](const auto& it, int8_t*) {
    if constexpr (kBf16) matmul_bf16(it, a);
    else matmul_f32(it, a);
  });
}

// ---- elementwise.metal ----

enum class Fmt { f32, bf16, q8, q4 };

template <class L, Fmt F> void op_embed(L& run, const Call& c) {
  constexpr int nscale = F == Fmt::q4 ? 2 : F == Fmt::q8 ? 1 : 0;  // scale (and q4's bias) buffers
  const SwEmbedParams& p = c.prm<SwEmbedParams>(3 + nscale);
  const EmbedArgs a{c.b<const int32_t>(0), c.b<const void>(1), nscale ? c.b<const float>(2) : nullptr,
                    nscale == 2 ? c.b<const float>(3) : nullptr, c.b<float>(2 + nscale),
                    p.n_tokens, p.hidden, p.cols_pad, p.vocab, p.group, p.affine};
  run.launch(c.groups_1d(), c.threads(), 0, [=](const auto& it, int8_t*) {
    if constexpr (F == Fmt::f32) embed_rows_f32(it, a);
    else if constexpr (F == Fmt::bf16) embed_rows_bf16(it, a);
    else if constexpr (F == Fmt::q8) embed_rows_q8(it, a);
    else embed_rows_q4(it, a);
  });
}

inline EltArgs elt_args(const SwEltParams& p) {
  EltArgs a{};
  a.n = p.n, a.heads = p.heads, a.dim = p.dim, a.rot = p.rot;
  return a;
}

// The flat ops: which Metal buffer fills which role of EltArgs, then the kernel.
#define SW_ELT_OP(kernel, pidx, bind)                                              \
  template <class L> void op_##kernel(L& run, const Call& c) {                    \
    EltArgs a = elt_args(c.prm<SwEltParams>(pidx));                                \
    bind;                                                                          \
    run.launch(c.groups_1d(), c.threads(), 0, [=](const auto& it, int8_t*) { kernel(it, a); }); \
  }
SW_ELT_OP(add_inplace, 2, (a.out = c.b<float>(0), a.x = c.b<const float>(1)))
SW_ELT_OP(silu_mul, 3, (a.x = c.b<const float>(0), a.u = c.b<const float>(1), a.out = c.b<float>(2)))
SW_ELT_OP(sigmoid_mul, 3, (a.x = c.b<const float>(0), a.u = c.b<const float>(1), a.out = c.b<float>(2)))
SW_ELT_OP(split_q_gate, 3, (a.x = c.b<const float>(0), a.out = c.b<float>(1), a.out2 = c.b<float>(2)))
SW_ELT_OP(rope, 2, (a.out = c.b<float>(0), a.x = c.b<const float>(1)))
SW_ELT_OP(gdn_gates, 5, (a.x = c.b<const float>(0), a.u = c.b<const float>(1), a.w = c.b<const float>(2),
                         a.out = c.b<float>(3), a.out2 = c.b<float>(4)))
SW_ELT_OP(gather_rows, 3, (a.x = c.b<const float>(0), a.idx = c.b<const int32_t>(1), a.out = c.b<float>(2)))
#undef SW_ELT_OP

// ---- rows.metal ----

inline RowsArgs rows_args(const SwRowsParams& p) {
  RowsArgs a{};
  a.rows = p.rows, a.cols = p.cols, a.k = p.k, a.eps = p.eps;
  return a;
}

template <class L> void op_rms_norm(L& run, const Call& c) {
  RowsArgs a = rows_args(c.prm<SwRowsParams>(3));
  a.x = c.b<const float>(0), a.w = c.b<const float>(1), a.out = c.b<float>(2);
  run.launch(c.groups_1d(), c.threads(), 0, [=](const auto& it, int8_t*) { rms_norm(it, a); });
}

template <class L> void op_argmax_rows(L& run, const Call& c) {
  RowsArgs a = rows_args(c.prm<SwRowsParams>(2));
  a.x = c.b<const float>(0), a.ids = c.b<int32_t>(1);
  const size_t off = c.local_off[1];
  run.launch(c.groups_1d(), c.threads(), c.local_bytes, [=](const auto& it, int8_t* lm) {
    argmax_rows(it, a, reinterpret_cast<float*>(lm), reinterpret_cast<int*>(lm + off));
  });
}

template <class L> void op_logsumexp_rows(L& run, const Call& c) {
  RowsArgs a = rows_args(c.prm<SwRowsParams>(2));
  a.x = c.b<const float>(0), a.out = c.b<float>(1);
  run.launch(c.groups_1d(), c.threads(), c.local_bytes,
             [=](const auto& it, int8_t* lm) { logsumexp_rows(it, a, reinterpret_cast<float*>(lm)); });
}

template <class L> void op_top_k_rows(L& run, const Call& c) {
  RowsArgs a = rows_args(c.prm<SwRowsParams>(4));
  a.x = c.b<const float>(0), a.skip = c.b<const int32_t>(1), a.ids = c.b<int32_t>(2), a.out = c.b<float>(3);
  const size_t off = c.local_off[1];
  run.launch(c.groups_1d(), c.threads(), c.local_bytes, [=](const auto& it, int8_t* lm) {
    top_k_rows(it, a, reinterpret_cast<float*>(lm), reinterpret_cast<int*>(lm + off));
  });
}

// ---- the registry ----

template <class L> struct Op {
  const char* name;
  int nbuf, nlocal, param;  // Metal buffer count, [[threadgroup]] count, the parameter block's index
  size_t param_bytes;
  void (*run)(L&, const Call&);
};

template <class L> const std::vector<Op<L>>& ops() {
#define SW_OP(name, nbuf, nlocal, P, fn) Op<L>{#name, nbuf, nlocal, nbuf - 1, sizeof(P), &fn}
  static const std::vector<Op<L>> r = {
      SW_OP(kv_quantize, 5, 0, SwKVQuantParams, op_kv_quantize<L>),
      SW_OP(tree_attn_partial, 14, 1, SwAttnParams, op_tree_attn_partial<L>),
      SW_OP(tree_attn_merge, 4, 0, SwAttnParams, op_tree_attn_merge<L>),
      SW_OP(gdn_conv, 8, 0, SwGDNParams, op_gdn_conv<L>),
      SW_OP(gdn_recur, 14, 1, SwGDNParams, op_gdn_recur<L>),
      SW_OP(gdn_commit, 16, 1, SwGDNParams, op_gdn_commit<L>),
      SW_OP(gdn_window, 5, 0, SwGDNParams, op_gdn_window<L>),
      SW_OP(q8_quantize_rows, 4, 1, SwQ8Params, op_q8_quantize_rows<L>),
      SW_OP(q8_matmul, 6, 0, SwQ8Params, op_q8_matmul<L>),
      SW_OP(q4_matmul, 7, 0, SwQ4Params, op_q4_matmul<L>),
      SW_OP(matmul_f32, 4, 0, SwQ8Params, (op_matmul<L, 0>)),
      SW_OP(matmul_bf16, 4, 0, SwQ8Params, (op_matmul<L, 1>)),
      SW_OP(embed_rows_f32, 4, 0, SwEmbedParams, (op_embed<L, Fmt::f32>)),
      SW_OP(embed_rows_bf16, 4, 0, SwEmbedParams, (op_embed<L, Fmt::bf16>)),
      SW_OP(embed_rows_q8, 5, 0, SwEmbedParams, (op_embed<L, Fmt::q8>)),
      SW_OP(embed_rows_q4, 6, 0, SwEmbedParams, (op_embed<L, Fmt::q4>)),
      SW_OP(add_inplace, 3, 0, SwEltParams, op_add_inplace<L>),
      SW_OP(silu_mul, 4, 0, SwEltParams, op_silu_mul<L>),
      SW_OP(sigmoid_mul, 4, 0, SwEltParams, op_sigmoid_mul<L>),
      SW_OP(split_q_gate, 4, 0, SwEltParams, op_split_q_gate<L>),
      SW_OP(rope, 3, 0, SwEltParams, op_rope<L>),
      SW_OP(gdn_gates, 6, 0, SwEltParams, op_gdn_gates<L>),
      SW_OP(gather_rows, 4, 0, SwEltParams, op_gather_rows<L>),
      SW_OP(rms_norm, 4, 0, SwRowsParams, op_rms_norm<L>),
      SW_OP(argmax_rows, 3, 2, SwRowsParams, op_argmax_rows<L>),
      SW_OP(logsumexp_rows, 3, 1, SwRowsParams, op_logsumexp_rows<L>),
      SW_OP(top_k_rows, 5, 2, SwRowsParams, op_top_k_rows<L>),
  };
#undef SW_OP
  return r;
}

// Bind one dispatch (the checks and messages of the emulated Metal device, so the backend
// sees one contract) and run it. `dev`: the device's name for errors.
template <class L>
void dispatch(L& run, const Op<L>& op, const std::vector<sapwood::gpu::Arg>& args, const sapwood::gpu::Launch& l,
              int max_threads) {
  Call c{op.name, {}, &l, {}, 0};
  if (int(args.size()) != op.nbuf)
    c.fail("takes " + std::to_string(op.nbuf) + " buffer arguments, got " + std::to_string(args.size()));
  if (int(l.threadgroup_bytes.size()) != op.nlocal)
    c.fail("takes " + std::to_string(op.nlocal) + " threadgroup memory arguments, got " +
           std::to_string(l.threadgroup_bytes.size()));
  if (l.threads <= 0 || l.threads % kSimd || l.threads > max_threads)
    c.fail("threads per threadgroup must be a positive multiple of 32 up to " + std::to_string(max_threads) +
           ", got " + std::to_string(l.threads));
  for (int i = 0; i < op.nlocal; ++i) {
    c.local_off[i] = c.local_bytes;
    c.local_bytes += (l.threadgroup_bytes[size_t(i)] + 15) / 16 * 16;
  }
  for (int i = 0; i < op.nbuf; ++i) {
    const sapwood::gpu::Arg& a = args[size_t(i)];
    const std::string at = "buffer(" + std::to_string(i) + ")";
    size_t avail;
    if (a.buf) {
      if (!a.buf->host || a.offset > a.buf->bytes)
        c.fail(at + ": offset " + std::to_string(a.offset) + " past its " + std::to_string(a.buf->bytes) + " bytes");
      c.buf[i] = static_cast<char*>(a.buf->host) + a.offset;
      avail = a.buf->bytes - a.offset;
    } else if (a.bytes) {
      c.buf[i] = const_cast<void*>(a.bytes);  // read while binding: the kernels get copies
      avail = a.size;
      if (i == op.param && a.size != op.param_bytes)
        c.fail(at + ": a constant block of " + std::to_string(a.size) + " bytes for a parameter block of " +
               std::to_string(op.param_bytes));
    } else {
      c.fail(at + " is unbound");
    }
    if (i == op.param && avail < op.param_bytes)
      c.fail(at + ": " + std::to_string(avail) + " bytes for a parameter block of " + std::to_string(op.param_bytes));
  }
  if (!l.groups[0] || !l.groups[1] || !l.groups[2]) return;  // an empty grid runs nothing
  op.run(run, c);
}

template <class L> const Op<L>* find_op(const std::string& name) {
  for (const Op<L>& op : ops<L>())
    if (name == op.name) return &op;
  return nullptr;
}

}  // namespace swsycl

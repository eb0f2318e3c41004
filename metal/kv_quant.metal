// Int8 KV quantize-and-store (docs/design.md "Int8 KV pages"): per token and KV head, each group of
// 32 dims shares one fp32 scale = amax / 127, q = clamp(rint(x / scale), -127, 127), scale 0 ->
// all 0. One threadgroup per (token, KV head) with one thread per dim, so a 32-dim group is
// exactly one simdgroup and its amax is one simd_max. Bitwise equal to reference/kv.py: the
// only float operations are |x|, max (exact), one division for the scale and one per element
// (the host builds without fast math, so `/` is correctly rounded), rint (ties to even).
#include <metal_stdlib>
#include "sw_common.h"
using namespace metal;

kernel void kv_quantize(device const float* x            [[buffer(0)]],  // [T, Hkv, D]
                        device char* q_out               [[buffer(1)]],  // pages or [T, Hkv, D]
                        device float* s_out              [[buffer(2)]],  // [..., D / 32]
                        device const int* page_table     [[buffer(3)]],
                        constant SwKVQuantParams& p      [[buffer(4)]],
                        uint3 tg                         [[threadgroup_position_in_grid]],  // (token, head)
                        uint tid                         [[thread_index_in_threadgroup]],
                        uint lane                        [[thread_index_in_simdgroup]])
{
  const int t = tg.x, h = tg.y, D = p.head_dim, d = tid;
  const float v = x[(t * p.n_kv_heads + h) * D + d];
  const float amax = simd_max(abs(v));
  const float scale = amax / 127.0f;
  const float q = scale == 0.0f ? 0.0f : clamp(rint(v / scale), -127.0f, 127.0f);
  int row = t * p.n_kv_heads + h;  // "direct": row (t, h) of [T, Hkv, D]
  if (p.page_size > 0) {
    const int pos = p.pos0 + t;
    row = (page_table[pos / p.page_size] * p.n_kv_heads + h) * p.page_size + pos % p.page_size;
  }
  q_out[row * D + d] = char(q);
  if (lane == 0) s_out[row * (D / SW_KV_GROUP) + d / SW_KV_GROUP] = scale;
}

// Int8 KV quantize-and-store, the SYCL twin of metal/kv_quant.metal (same rule, same order):
// one work-group per (token, KV head), one work-item per dim, a 32-dim group = one sub-group,
// amax by one sub-group max. Work-group g of the 1-D range is (token g / Hkv, head g % Hkv).
#pragma once
#include "sw_sycl_common.hpp"

namespace swsycl {

template <class It>
void kv_quantize(const It& it, const KVQuantArgs& a) {
  const int g = int(it.get_group(0)), t = g / a.n_kv_heads, h = g % a.n_kv_heads;
  const int D = a.head_dim, d = int(it.get_local_id(0));
  const float v = a.x[(t * a.n_kv_heads + h) * D + d];
  const float amax = sg_max(it, fabs(v));
  const float scale = amax / 127.0f;
  const float q = scale == 0.0f ? 0.0f : clampf(rint(v / scale), -127.0f, 127.0f);
  int row = t * a.n_kv_heads + h;  // direct: row (t, h) of [T, Hkv, D]
  if (a.page_size > 0) {
    const int pos = a.pos0 + t;
    row = (a.page_table[pos / a.page_size] * a.n_kv_heads + h) * a.page_size + pos % a.page_size;
  }
  a.q_out[row * D + d] = int8_t(q);
  if (sg_lane(it) == 0) a.s_out[row * (D / kKVGroup) + d / kKVGroup] = scale;
}

}  // namespace swsycl

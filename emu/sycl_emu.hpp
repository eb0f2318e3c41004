// The SYCL 2020 subset of sycl/*.hpp, emulated on the fiber scheduler (see fiber.hpp). Included
// by sycl/sw_sycl_common.hpp when SW_SYCL_EMU is defined, in place of <sycl/sycl.hpp> and the
// real traits. sycl/README.md lists the subset; this header covers exactly that list.
#pragma once

#include "fiber.hpp"

namespace swemu {

// The part of sycl::nd_item<1> the kernel bodies use.
struct NdItem {
  const ThreadCtx* c;
  size_t get_local_id(int) const { return size_t(c->tid); }
  size_t get_group(int) const { return size_t(c->tg[0]); }
  size_t get_local_range(int) const { return size_t(c->nthreads); }
  size_t get_group_range(int) const { return size_t(c->groups[0]); }
};

}  // namespace swemu

namespace swsycl {

// group_barrier(it.get_group()) and the sub-group collectives.
template <class It> inline void barrier(const It&, int line = __builtin_LINE()) {
  swemu::runner().barrier("group_barrier", line);
}
template <class It> inline int sg_lane(const It& it) { return it.c->lane; }
template <class It> inline int sg_index(const It& it) { return it.c->sg; }
template <class It> inline int sg_count(const It& it) { return it.c->nsg; }
// select_from_group(sg, x, src), permute_group_by_xor(sg, x, mask), and sg_sum: the xor
// butterfly of sw_sycl_common.hpp's device sg_sum, step by step over the 32 lanes' values, each
// lane keeping its own result (one rendezvous instead of five shuffles).
template <class It, class T> inline T sg_shuffle(const It&, T x, int src_lane, int line = __builtin_LINE()) {
  return swemu::runner().collective("select_from_group", line, &swemu::Ops<T>::shuffle, x, src_lane);
}
template <class It, class T> inline T sg_shuffle_xor(const It&, T x, int mask, int line = __builtin_LINE()) {
  return swemu::runner().collective("permute_group_by_xor", line, &swemu::Ops<T>::shuffle_xor, x, mask);
}
template <class T> void butterfly_sum(swemu::Runner::Slot& s) {
  T v[swemu::kSimdWidth], w[swemu::kSimdWidth];
  for (int l = 0; l < swemu::kSimdWidth; ++l) __builtin_memcpy(&v[l], s.in[l], sizeof(T));
  for (int m = swemu::kSimdWidth / 2; m >= 1; m /= 2) {
    for (int l = 0; l < swemu::kSimdWidth; ++l) w[l] = T(v[l] + v[l ^ m]);
    for (int l = 0; l < swemu::kSimdWidth; ++l) v[l] = w[l];
  }
  for (int l = 0; l < swemu::kSimdWidth; ++l) __builtin_memcpy(s.out[l], &v[l], sizeof(T));
}
template <class It, class T> inline T sg_sum(const It&, T x, int line = __builtin_LINE()) {
  return swemu::runner().collective("sg_sum (xor butterfly)", line, &butterfly_sum<T>, x);
}
template <class It, class T> inline T sg_max(const It&, T x, int line = __builtin_LINE()) {
  return swemu::runner().collective("reduce_over_group(maximum)", line, &swemu::Ops<T>::max, x);
}

inline float exp(float x) { return __builtin_expf(x); }
inline float log(float x) { return __builtin_logf(x); }
inline float sqrt(float x) { return __builtin_sqrtf(x); }
inline float bits_to_float(uint32_t b) {  // sycl::bit_cast<float>
  float f;
  __builtin_memcpy(&f, &b, sizeof f);
  return f;
}
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float rint(float x) { return __builtin_nearbyintf(x); }
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float fabs(float x) { return __builtin_fabsf(x); }
inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
inline float fmin(float a, float b) { return __builtin_fminf(a, b); }

}  // namespace swsycl

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

// group_barrier(it.get_group()) and sub-group reduce_over_group(sg, x, plus / maximum).
template <class It> inline void barrier(const It&, int line = __builtin_LINE()) {
  swemu::runner().barrier("group_barrier", line);
}
template <class It> inline int sg_lane(const It& it) { return it.c->lane; }
template <class It> inline int sg_index(const It& it) { return it.c->sg; }
template <class It> inline int sg_count(const It& it) { return it.c->nsg; }
template <class It, class T> inline T sg_sum(const It&, T x, int line = __builtin_LINE()) {
  return swemu::runner().collective("reduce_over_group(plus)", line, &swemu::Ops<T>::sum, x);
}
template <class It, class T> inline T sg_max(const It&, T x, int line = __builtin_LINE()) {
  return swemu::runner().collective("reduce_over_group(maximum)", line, &swemu::Ops<T>::max, x);
}

inline float exp(float x) { return __builtin_expf(x); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float rint(float x) { return __builtin_nearbyintf(x); }
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float fabs(float x) { return __builtin_fabsf(x); }
inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
inline float fmin(float a, float b) { return __builtin_fminf(a, b); }

}  // namespace swsycl

// The Metal Shading Language subset of metal/*.metal, as C++17 over the fiber scheduler, so the
// unmodified shaders compile with g++ and run on a CPU. metal/README.md lists the subset; this
// header covers exactly that list (anything else fails to compile here, which is the point:
// a new construct must be added to both).
//
// Compile the shaders with: -fsigned-char (MSL `char` is signed) -Wno-attributes ([[buffer(n)]]
// and the thread-position attributes are parsed and ignored; the launcher passes the built-ins
// explicitly) -I emu/include (for <metal_stdlib>).
#pragma once

#include <cstdint>

#include "fiber.hpp"

// Address spaces are one flat memory on the CPU.
#define device
#define constant
#define thread
#define threadgroup
#define kernel
// [[threadgroup(n)]] cannot survive `threadgroup` being an empty macro, so the shaders spell it
// through this macro (metal/sw_common.h defines the real attribute for the Metal compiler).
#define SW_THREADGROUP_ARG(i)

namespace metal {

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;

// ---- vector types: components x, y, z, w; element-wise + - *; converting constructors ----
template <class T, int N> struct vec;
template <class T> struct vec<T, 2> {
  T x, y;
  vec() = default;
  constexpr vec(T a, T b) : x(a), y(b) {}
  template <class U> explicit constexpr vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
template <class T> struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  constexpr vec(T a, T b, T c) : x(a), y(b), z(c) {}
  template <class U> explicit constexpr vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
template <class T> struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  constexpr vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  template <class U> explicit constexpr vec(const vec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
#define SW_VEC_BINOP(op)                                                             \
  template <class T, int N> vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) { \
    for (int i = 0; i < N; ++i) a[i] = T(a[i] op b[i]);                              \
    return a;                                                                        \
  }
SW_VEC_BINOP(+)
SW_VEC_BINOP(-)
SW_VEC_BINOP(*)
#undef SW_VEC_BINOP

using float2 = vec<float, 2>;
using float4 = vec<float, 4>;
using int2 = vec<int, 2>;
using int4 = vec<int, 4>;
using uint2 = vec<uint, 2>;
using uint3 = vec<uint, 3>;
using char4 = vec<signed char, 4>;

// ---- math: float versions of what the shaders call (libm semantics, round-to-nearest; the
// compiler builtins avoid parsing <cmath>) ----
inline float exp(float x) { return __builtin_expf(x); }
inline float log(float x) { return __builtin_logf(x); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float rint(float x) { return __builtin_nearbyintf(x); }  // ties to even, like MSL rint
inline float sqrt(float x) { return __builtin_sqrtf(x); }
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float abs(float x) { return __builtin_fabsf(x); }
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline int max(int a, int b) { return a < b ? b : a; }
inline int min(int a, int b) { return b < a ? b : a; }
inline float clamp(float x, float lo, float hi) { return min(max(x, lo), hi); }
inline float select(float a, float b, bool c) { return c ? b : a; }
inline int select(int a, int b, bool c) { return c ? b : a; }
// as_type<T>(x): the bits of x as a T of the same size (bf16 bits -> float).
template <class T, class U> inline T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type between types of different sizes");
  T t;
  __builtin_memcpy(&t, &x, sizeof t);
  return t;
}

// ---- synchronisation ----
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

inline void threadgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  swemu::runner().barrier("threadgroup_barrier", line);
}

// ---- simdgroup functions (width 32; every lane of the simdgroup must call) ----
template <class T> T simd_sum(T v, int line = __builtin_LINE()) {
  return swemu::runner().collective("simd_sum", line, &swemu::Ops<T>::sum, v);
}
template <class T> T simd_max(T v, int line = __builtin_LINE()) {
  return swemu::runner().collective("simd_max", line, &swemu::Ops<T>::max, v);
}
template <class T> T simd_min(T v, int line = __builtin_LINE()) {
  return swemu::runner().collective("simd_min", line, &swemu::Ops<T>::min, v);
}
template <class T> T simd_shuffle(T v, ushort lane, int line = __builtin_LINE()) {
  return swemu::runner().collective("simd_shuffle", line, &swemu::Ops<T>::shuffle, v, int(lane));
}
template <class T> T simd_shuffle_xor(T v, ushort mask, int line = __builtin_LINE()) {
  return swemu::runner().collective("simd_shuffle_xor", line, &swemu::Ops<T>::shuffle_xor, v, int(mask));
}
template <class T> T simd_broadcast(T v, ushort lane, int line = __builtin_LINE()) {
  return swemu::runner().collective("simd_broadcast", line, &swemu::Ops<T>::shuffle, v, int(lane));
}

}  // namespace metal

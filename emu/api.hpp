// The extern "C" surface shared by every emulator shared object (one per kernel family and
// backend, loaded by tests/gpu_util.py through ctypes): entries return 0, or -1 with the
// message in sw_last_error(). Host-side planning (ancestor lists, chunk counts, launch sizes)
// lives in the launchers, next to the kernel launches it feeds.
#pragma once

#include "fiber.hpp"

#define SW_API extern "C" __attribute__((visibility("default")))

namespace swemu {
inline char* last_error() {
  static char e[1024];
  return e;
}
template <class F> int guard(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(last_error(), 1024, "%s", e.what());
    return -1;
  }
}
inline void require(bool ok, const char* what) {
  if (!ok) throw Error("bad launch: %s", what);
}
inline int round32(int n) { return (n + 31) / 32 * 32; }
inline int imin(int a, int b) { return b < a ? b : a; }
inline int imax(int a, int b) { return a < b ? b : a; }

// A zero-filled host array (std::vector without its header cost).
template <class T> struct Buf {
  T* p = nullptr;
  Buf() = default;
  explicit Buf(size_t n) { resize(n); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() { std::free(p); }
  void resize(size_t n) {
    std::free(p);
    p = static_cast<T*>(std::calloc(n ? n : 1, sizeof(T)));
    if (!p) throw Error("out of host memory");
  }
  T* data() { return p; }
  T& operator[](size_t i) { return p[i]; }
};
}  // namespace swemu

SW_API const char* sw_last_error() { return swemu::last_error(); }
// Barrier waits so far (a test asserts the kernels really synchronise).
SW_API long sw_barrier_waits() { return swemu::runner().barrier_waits(); }

// Shared error handling and small utilities for the sapwood runtime.
#pragma once
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace sapwood {

// Bad input from the caller: becomes a Python ValueError naming the offending value.
struct InputError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// Out of KV pages or context: becomes a Python MemoryError-like RuntimeError subclass.
struct CapacityError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// Finite-input helpers that compile to plain instructions (std::fmax/fmin/nearbyint become
// libm calls on baseline x86-64 because of their NaN and rounding-mode contracts).
inline float max_f(float a, float b) { return a > b ? a : b; }
inline float clamp_f(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
// Round half to even (np.rint) for |x| < 2^22: adding and removing 1.5 * 2^23 leaves the
// float rounded to an integer by the FPU's default round-to-nearest-even.
// (Without -ffast-math the compiler may not fold x + b - b, which would change the value.)
inline float rint_small(float x) {
  const float big = 12582912.0f;
  return (x + big) - big;
}

// The one symmetric quantizer (KV groups, q8/q4 weights, int8 activations):
// scale = amax / qmax, q = clamp(rint(x / scale), -qmax, qmax), scale 0 -> q = 0.
inline int8_t quantize_one(float x, float s, float qmax) {  // s > 0
  return int8_t(clamp_f(rint_small(x / s), -qmax, qmax));
}
inline float quantize_block(const float* x, int n, float qmax, int8_t* q) {
  // amax over the bit patterns with the sign cleared: for finite floats the integer order is
  // the float order, and an integer max reduction vectorises where the float one does not.
  uint32_t abits = 0;
  for (int i = 0; i < n; ++i) {
    uint32_t b;
    __builtin_memcpy(&b, x + i, 4);
    b &= 0x7fffffffu;
    abits = b > abits ? b : abits;
  }
  float amax;
  __builtin_memcpy(&amax, &abits, 4);
  const float s = amax / qmax;
  for (int i = 0; i < n; ++i) q[i] = s == 0.0f ? 0 : quantize_one(x[i], s, qmax);
  return s;
}

#define SW_CHECK(cond, ...) \
  do { if (!(cond)) throw ::sapwood::InputError(::sapwood::cat(__VA_ARGS__)); } while (0)

}  // namespace sapwood

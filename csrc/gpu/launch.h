// Small helpers the GPU backend's files share to spell a dispatch: arguments and launch shapes.
#pragma once
#include <utility>
#include <vector>

#include "device.h"

namespace sapwood::gpu {

template <class T> Arg val(const T& v) { return Arg::value(v); }
inline Arg buf(const Buffer& b, size_t byte_offset = 0) { return Arg::of(b, byte_offset); }
inline Launch grid(uint32_t x, uint32_t y, int threads, std::vector<size_t> tg = {}) {
  Launch l;
  l.groups[0] = x, l.groups[1] = y, l.threads = threads, l.threadgroup_bytes = std::move(tg);
  return l;
}
inline uint32_t blocks(size_t n, int per) { return uint32_t((n + per - 1) / per); }
inline int round32(int n) { return (n + 31) / 32 * 32; }

}  // namespace sapwood::gpu

// Storage for the large arrays a decode step streams (weights, the KV pool), backed by
// transparent huge pages where the OS offers them on request (Linux THP in "madvise" mode,
// the common default). With 4 KiB pages, streaming the weights costs a TLB miss every 4 KiB:
// the realistic 0.66B shape's one-row matmuls (2 threads, 2-core Xeon) took 27.0 ms on small
// pages and 25.6 on huge ones (medians of 12 passes, alternated processes); a whole decode
// step gains less (~1%, within the host's noise).
#pragma once
#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace sapwood {

constexpr size_t kHugePage = size_t(2) << 20;

// Large arrays start on a huge-page boundary and their whole huge pages are marked for THP
// (the tail stays on small pages, so no memory is wasted). Small ones: plain malloc. Both are
// released with free().
inline void* alloc_huge_capable(size_t bytes) {
  void* p = nullptr;
  if (bytes >= kHugePage) {
    if (posix_memalign(&p, kHugePage, bytes) != 0) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    madvise(p, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
    return p;
  }
  p = std::malloc(bytes ? bytes : 1);
  if (!p) throw std::bad_alloc();
  return p;
}

template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(alloc_huge_capable(n * sizeof(T))); }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const HugePageAllocator<U>&) const { return false; }
};

template <class T>
using BigVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace sapwood

// Storage for the large arrays a decode step streams (weights, the KV pool), backed by
// transparent huge pages where the OS offers them on request (Linux THP in "madvise" mode,
// the common default). With 4 KiB pages, streaming the weights costs a TLB miss every 4 KiB
// and reads slower: the read-bandwidth probe 25-26 GB/s on small pages, 33-35 on huge ones
// (2-core Xeon).
//
// Arrays are carved from shared huge-page chunks (HugeArena) rather than each taking its own
// pages: a model is many matrices of 0.1-6 MB, and on their own each one's tail beyond its
// last whole huge page (all of a matrix under 2 MiB) stayed on small pages: with the arena
// the realistic 0.66B shape's process holds 213 MB more on huge pages (AnonHugePages; 630 MB
// of weights). One-row matmuls over 40 separate 3.7 MB matrices read 13.6-13.9 GB/s on one
// thread against 15.7-16.0 for one 155 MB matrix (15.3-15.5 from the arena); the realistic
// decode step at context 64 went 25.7-26.9 -> 25.1-25.7 ms and the bundled target's
// one-token verify 351-365 -> 326-351 us (alternated processes, 6 and 4 each).
#pragma once
#include <cstddef>
#include <vector>

namespace sapwood {

constexpr size_t kHugePage = size_t(2) << 20;

// Arrays from kArenaMin bytes come from the arena (64-byte aligned), smaller ones from malloc.
// The arena bump-allocates in chunks of kArenaChunk (2 MiB aligned, madvised as a whole); an
// array over half a chunk gets a chunk of its own, whole huge pages. A chunk is returned to
// the OS when its last array is freed, and freeing the newest array of the current chunk
// gives its space back, so a model's storage goes away with the model.
constexpr size_t kArenaMin = size_t(64) << 10;
constexpr size_t kArenaChunk = size_t(32) << 20;
void* alloc_huge_capable(size_t bytes);
void free_huge_capable(void* p, size_t bytes);
size_t arena_chunks();  // chunks held now (for tests)

// Zero-filled storage that takes memory only as it is first written: an anonymous mapping
// (2 MiB aligned, madvised for huge pages) whose pages the OS supplies, zeroed, on first
// touch. The KV pool is one: an engine's resident memory grows with the positions it uses
// instead of max_context's whole pool being allocated and zeroed at load. Elsewhere calloc.
void* alloc_lazy_zeroed(size_t bytes);
void free_lazy_zeroed(void* p, size_t bytes);

template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(alloc_huge_capable(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { free_huge_capable(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const HugePageAllocator<U>&) const { return false; }
};

template <class T>
using BigVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace sapwood

// Storage for the large arrays a decode step streams (weights, the KV pool), backed by
// transparent huge pages where the OS offers them on request (Linux THP in "madvise" mode,
// the common default). With 4 KiB pages, streaming the weights costs a TLB miss every 4 KiB
// and reads slower.
//
// Arrays are carved from shared huge-page chunks (HugeArena) rather than each taking its own
// pages: a model is many matrices of 0.1-6 MB, and on their own each one's tail beyond its
// last whole huge page (all of a matrix under 2 MiB) stayed on small pages, so one-row matmuls
// over many separate matrices read slower than over one large one; from the arena they read
// nearly as fast.
#pragma once
#include <cstddef>
#include <new>
#include <utility>
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
  // resize(n) leaves the new elements default-initialised (uninitialised, for the arithmetic
  // types stored here): a weight matrix's pages are first touched by the loader's worker
  // threads as they store its rows, in parallel, not zero-filled by one thread beforehand.
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  void deallocate(T* p, size_t n) { free_huge_capable(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const HugePageAllocator<U>&) const { return false; }
};

template <class T>
using BigVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace sapwood

#include "huge_pages.h"

#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace sapwood {
namespace {

constexpr size_t kAlign = 64;

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

class HugeArena {
 public:
  void* alloc(size_t bytes) {
    const size_t need = round_up(bytes, kAlign);
    std::lock_guard<std::mutex> lk(mu_);
    if (need > kArenaChunk / 2) return new_chunk(round_up(need, kHugePage), need, false);
    if (current_ != chunks_.end() && current_->second.used + need <= current_->second.size) {
      Chunk& c = current_->second;
      char* p = current_->first + c.used;
      c.used += need, ++c.live;
      return p;
    }
    return new_chunk(kArenaChunk, need, true);
  }

  void free(void* ptr, size_t bytes) {
    char* p = static_cast<char*>(ptr);
    std::lock_guard<std::mutex> lk(mu_);
    auto it = std::prev(chunks_.upper_bound(p));  // the chunk holding p
    Chunk& c = it->second;
    if (--c.live == 0) {
      if (it == current_) current_ = chunks_.end();
      std::free(it->first);
      chunks_.erase(it);
      return;
    }
    // the newest array of its chunk: its space can be handed out again
    if (p + round_up(bytes, kAlign) == it->first + c.used) c.used = size_t(p - it->first);
  }

  size_t chunks() {
    std::lock_guard<std::mutex> lk(mu_);
    return chunks_.size();
  }

 private:
  struct Chunk {
    size_t size = 0, used = 0;
    long live = 0;
  };
  using Map = std::map<char*, Chunk>;

  Map::iterator insert(size_t size) {
    void* base = nullptr;
    if (posix_memalign(&base, kHugePage, size) != 0) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    madvise(base, size, MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
    return chunks_.emplace(static_cast<char*>(base), Chunk{size, 0, 0}).first;
  }
  // A chunk of `size` bytes whose first `need` bytes are handed out; `shared`: later arrays
  // may follow in it (it becomes the current chunk).
  void* new_chunk(size_t size, size_t need, bool shared) {
    Map::iterator it = insert(size);
    it->second.used = need, it->second.live = 1;
    if (shared) current_ = it;
    return it->first;
  }

  std::mutex mu_;
  Map chunks_;
  Map::iterator current_ = chunks_.end();
};

// Never destroyed: arrays in static objects may be freed after static destructors run.
HugeArena& arena() {
  static HugeArena* a = new HugeArena;
  return *a;
}

}  // namespace

void* alloc_huge_capable(size_t bytes) {
  if (bytes >= kArenaMin) return arena().alloc(bytes);
  void* p = std::malloc(bytes ? bytes : 1);
  if (!p) throw std::bad_alloc();
  return p;
}

void free_huge_capable(void* p, size_t bytes) {
  if (!p) return;
  if (bytes >= kArenaMin) arena().free(p, bytes);
  else std::free(p);
}

size_t arena_chunks() { return arena().chunks(); }

void* alloc_lazy_zeroed(size_t bytes) {
#if defined(__linux__) && defined(MAP_ANONYMOUS)
  // map one huge page more than asked and trim both ends to 2 MiB alignment
  const size_t size = round_up(bytes ? bytes : 1, kHugePage), span = size + kHugePage;
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  char* base = static_cast<char*>(m);
  char* p = reinterpret_cast<char*>(round_up(reinterpret_cast<size_t>(base), kHugePage));
  if (p > base) munmap(base, size_t(p - base));
  if (p + size < base + span) munmap(p + size, size_t(base + span - (p + size)));
#ifdef MADV_HUGEPAGE
  madvise(p, size, MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
  return p;
#else
  void* p = std::calloc(bytes ? bytes : 1, 1);
  if (!p) throw std::bad_alloc();
  return p;
#endif
}

void free_lazy_zeroed(void* p, size_t bytes) {
  if (!p) return;
#if defined(__linux__) && defined(MAP_ANONYMOUS)
  munmap(p, round_up(bytes ? bytes : 1, kHugePage));
#else
  (void)bytes;
  std::free(p);
#endif
}

}  // namespace sapwood

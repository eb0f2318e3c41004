// A threadgroup as cooperative fibers: the emulator's scheduler (docs/design.md "Keeping GPU kernels
// correct without the GPU").
//
// Every GPU thread of one threadgroup runs as a fiber on its own small stack, all on one OS
// thread. A fiber runs until it reaches a synchronisation point (threadgroup barrier or simdgroup
// collective), then switches straight to the next ready fiber (round-robin); the last thread to
// arrive completes the barrier or collective and runs on. So
// barriers and simd_sum/simd_max/shuffles are real rendezvous points with real data exchange, and
// a missing barrier shows up as a read of data another thread has not written yet (threadgroup
// memory is poisoned with 0xFF bytes, i.e. NaN floats, at every group start).
//
// Errors the scheduler reports (as swemu::Error, thrown from Runner::launch()):
// - a barrier reached by only part of the threadgroup (a thread returned early, or is stuck in a
//   simdgroup collective): the GPU would hang or silently misbehave;
// - a simdgroup collective called by only part of its 32 lanes;
// - threads of one group at different barriers, or lanes at different collectives.
// Sites are compared by source line, captured with __builtin_LINE() at the call.
//
// Context switch: hand-written for x86-64 and AArch64 (callee-saved registers + stack pointer,
// ~10 ns); elsewhere, or with -DSW_EMU_UCONTEXT, ucontext (portable, ~10x slower: it saves the
// signal mask with a syscall).
// Not thread-safe: one launch at a time per Runner; runner() gives each OS thread its own.
#pragma once

#if defined(SW_EMU_UCONTEXT) || !(defined(__x86_64__) || defined(__aarch64__))
#define SW_EMU_USE_UCONTEXT 1
#ifndef _XOPEN_SOURCE
#define _XOPEN_SOURCE 700  // before any system header (macOS requires it for ucontext)
#endif
#include <ucontext.h>
#endif

// Light headers only (no <string>/<vector>/<cmath>): the tests compile one shared object per
// kernel family and backend, and header parsing dominated the build time.
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include <sys/mman.h>

namespace swemu {

struct Error : std::exception {
  char msg[768];
  explicit Error(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
  }
  const char* what() const noexcept override { return msg; }
};

constexpr int kSimdWidth = 32;

// What each emulated thread is told about itself (the Metal attributes / SYCL nd_item data).
struct ThreadCtx {
  uint32_t tg[3];      // threadgroup position in the grid
  uint32_t groups[3];  // threadgroups per grid
  int tid, lane, sg, nsg, nthreads;
  char* smem;          // this group's threadgroup (local) memory
};

#ifndef SW_EMU_USE_UCONTEXT
extern "C" void sw_emu_switch(void** save_sp, void* to_sp);
extern "C" void sw_emu_trampoline();
// SW_EMU_SWITCH_ELSEWHERE: another translation unit of the same binary defines the two routines
// (in _core, the emulated Metal and SYCL devices share one set).
#ifndef SW_EMU_SWITCH_ELSEWHERE
// switch: push the callee-saved registers, save sp, load the other sp, pop, return. A new
// fiber's stack is prepared so that the first switch "returns" into the trampoline, which calls
// the entry function (second saved register) with its argument (first saved register).
#if defined(__APPLE__)
#define SW_SYM(n) "_" #n
#define SW_FUNC(n) ".globl _" #n "\n.private_extern _" #n "\n_" #n ":\n"
#define SW_END(n) ""
#else
#define SW_SYM(n) #n
#define SW_FUNC(n) ".globl " #n "\n.hidden " #n "\n.type " #n ",%function\n" #n ":\n"
#define SW_END(n) ".size " #n ", .-" #n "\n"
#endif
#if defined(__x86_64__)  // System V: rbx rbp r12-r15
asm(".text\n.p2align 4\n" SW_FUNC(sw_emu_switch) R"(
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
)" SW_END(sw_emu_switch) SW_FUNC(sw_emu_trampoline) R"(
  movq %r12, %rdi
  callq *%r13
  ud2
)" SW_END(sw_emu_trampoline));
#else  // AArch64 (AAPCS64 and Apple): x19-x30, d8-d15; x18 is left alone (platform register)
asm(".text\n.p2align 2\n" SW_FUNC(sw_emu_switch) R"(
  sub sp, sp, #176
  stp x19, x20, [sp, #0]
  stp x21, x22, [sp, #16]
  stp x23, x24, [sp, #32]
  stp x25, x26, [sp, #48]
  stp x27, x28, [sp, #64]
  stp x29, x30, [sp, #80]
  stp d8, d9, [sp, #96]
  stp d10, d11, [sp, #112]
  stp d12, d13, [sp, #128]
  stp d14, d15, [sp, #144]
  mov x9, sp
  str x9, [x0]
  mov sp, x1
  ldp x19, x20, [sp, #0]
  ldp x21, x22, [sp, #16]
  ldp x23, x24, [sp, #32]
  ldp x25, x26, [sp, #48]
  ldp x27, x28, [sp, #64]
  ldp x29, x30, [sp, #80]
  ldp d8, d9, [sp, #96]
  ldp d10, d11, [sp, #112]
  ldp d12, d13, [sp, #128]
  ldp d14, d15, [sp, #144]
  add sp, sp, #176
  ret
)" SW_END(sw_emu_switch) SW_FUNC(sw_emu_trampoline) R"(
  mov x0, x19
  blr x20
  brk #0
)" SW_END(sw_emu_trampoline));
#endif
#endif  // SW_EMU_SWITCH_ELSEWHERE
#endif

class Runner {
 public:
  enum State : uint8_t { kReady, kBarrier, kSimd, kDone };
  static constexpr int kMaxThreads = 1024;

  // Run f(ctx) for every thread of every threadgroup of the grid; groups run one after
  // another. nthreads must be a multiple of the simd width (the kernels are written that way).
  template <class F>
  void launch(const uint32_t groups[3], int nthreads, size_t smem_bytes, F&& f) {
    body_ = [](void* u, const ThreadCtx& c) { (*static_cast<F*>(u))(c); };
    user_ = &f;
    run_grid(groups, nthreads, smem_bytes);
  }

  // --- called from inside fibers ---
  void barrier(const char* what, int line) {
    if (bar_arrived_ == 0) {
      bar_line_ = line;
      bar_what_ = what;
    } else if (line != bar_line_) {
      fail("divergent barriers: thread %d at %s line %d while others wait at line %d", cur_, what, line,
           bar_line_);
    }
    ++barrier_waits_;
    if (++bar_arrived_ == n_) {  // the last arrival releases everyone and runs on
      bar_arrived_ = 0;
      for (int i = 0; i < n_; ++i)
        if (st_[i] == kBarrier) st_[i] = kReady;
      return;
    }
    block(kBarrier);
  }

  // A simdgroup collective: every lane deposits `in`, the last lane to arrive runs op over all
  // 32 slots, every lane gets its own `out` slot back.
  struct Slot {
    int arrived = 0, line = 0;
    const char* what = nullptr;
    void (*op)(Slot&) = nullptr;
    alignas(16) unsigned char in[kSimdWidth][16];
    alignas(16) unsigned char out[kSimdWidth][16];
    int arg[kSimdWidth];
  };
  template <class T>
  T collective(const char* what, int line, void (*op)(Slot&), T v, int arg = 0) {
    static_assert(sizeof(T) <= 16, "collective value too large");
    const int t = cur_, lane = t % kSimdWidth;
    Slot& s = slots_[t / kSimdWidth];
    if (s.arrived == 0) {
      s.what = what, s.line = line, s.op = op;
    } else if (s.line != line || s.op != op) {
      fail("divergent simdgroup collectives: lane %d of simdgroup %d calls %s at line %d while other lanes "
           "wait in %s at line %d", lane, t / kSimdWidth, what, line, s.what, s.line);
    }
    std::memcpy(s.in[lane], &v, sizeof(T));
    s.arg[lane] = arg;
    if (++s.arrived == kSimdWidth) {
      s.op(s);
      s.arrived = 0;
      const int b = t - lane;
      for (int i = b; i < b + kSimdWidth; ++i)
        if (st_[i] == kSimd) st_[i] = kReady;
    } else {
      block(kSimd);
    }
    T r;
    std::memcpy(&r, s.out[lane], sizeof(T));
    return r;
  }

  long barrier_waits() const { return barrier_waits_; }

  ~Runner() {
    if (stacks_) munmap(stacks_, stacks_bytes_);
    std::free(smem_);
  }

 private:
  static constexpr size_t kStack = 64 * 1024, kGuard = 4096;

  // Park the current fiber and switch straight to the next ready one (round-robin), or back
  // to the scheduler loop when none is ready (all done, or a deadlock to diagnose).
  void block(State s) {
    st_[cur_] = s;
    yield_from(cur_);
  }
  void yield_from(int t) {
    for (int k = 1; k <= n_; ++k) {
      const int u = (t + k) % n_;
      if (st_[u] == kReady) {
        if (u == t) return;  // only possible for a fiber that was just released
        cur_ = u;
        jump(t, u);
        return;
      }
    }
    to_main(t);
  }

  [[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(error_, sizeof error_, fmt, ap);
    va_end(ap);
    for (;;) to_main(cur_);
  }

  static void entry(void* self) {
    Runner* r = static_cast<Runner*>(self);
    r->body_(r->user_, r->ctx_[r->cur_]);
    r->st_[r->cur_] = kDone;
    ++r->done_;
    for (;;) r->yield_from(r->cur_);
  }

#ifndef SW_EMU_USE_UCONTEXT
  void jump(int from, int to) { sw_emu_switch(&sp_[from], sp_[to]); }
  void to_main(int from) { sw_emu_switch(&sp_[from], main_sp_); }
  void resume(int t) { sw_emu_switch(&main_sp_, sp_[t]); }
  void prepare(int t) {
    void** sp;
#if defined(__x86_64__)
    sp = reinterpret_cast<void**>(stack_top(t) - 72);  // after 6 pops + ret: rsp % 16 == 0
    sp[0] = sp[1] = sp[4] = sp[5] = nullptr;            // r15, r14, rbx, rbp
    sp[2] = reinterpret_cast<void*>(&Runner::entry);    // r13: entry
    sp[3] = this;                                       // r12: its argument
    sp[6] = reinterpret_cast<void*>(&sw_emu_trampoline);  // return address
#else
    sp = reinterpret_cast<void**>(stack_top(t) - 176);  // the switch's frame; sp stays 16-aligned
    std::memset(sp, 0, 176);
    sp[0] = this;                                       // x19: argument
    sp[1] = reinterpret_cast<void*>(&Runner::entry);    // x20: entry
    sp[11] = reinterpret_cast<void*>(&sw_emu_trampoline);  // x30: return address
#endif
    sp_[t] = sp;
  }
  void* main_sp_ = nullptr;
  void* sp_[kMaxThreads];
#else
  void jump(int from, int to) { swapcontext(&uc_[from], &uc_[to]); }
  void to_main(int from) { swapcontext(&uc_[from], &main_uc_); }
  void resume(int t) { swapcontext(&main_uc_, &uc_[t]); }
  static void uc_entry(unsigned hi, unsigned lo) {
    entry(reinterpret_cast<void*>((uintptr_t(hi) << 32) | uintptr_t(lo)));
  }
  void prepare(int t) {
    getcontext(&uc_[t]);
    uc_[t].uc_stack.ss_sp = stack_top(t) - kStack + kGuard;
    uc_[t].uc_stack.ss_size = kStack - kGuard;
    uc_[t].uc_link = nullptr;
    const uintptr_t p = reinterpret_cast<uintptr_t>(this);
    makecontext(&uc_[t], reinterpret_cast<void (*)()>(&Runner::uc_entry), 2, unsigned(p >> 32),
                unsigned(p & 0xffffffffu));
  }
  ucontext_t main_uc_;
  ucontext_t uc_[kMaxThreads];
#endif

  char* stack_top(int t) { return static_cast<char*>(stacks_) + size_t(t + 1) * kStack; }

  void ensure_stacks(int n) {
    if (n <= n_stacks_) return;
    if (stacks_) munmap(stacks_, stacks_bytes_);
    stacks_bytes_ = size_t(n) * kStack;
    stacks_ = mmap(nullptr, stacks_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stacks_ == MAP_FAILED) {
      stacks_ = nullptr;
      n_stacks_ = 0;
      throw Error("emulator: cannot map fiber stacks");
    }
    for (int t = 0; t < n; ++t)  // a guard page under each stack turns an overflow into a fault
      mprotect(static_cast<char*>(stacks_) + size_t(t) * kStack, kGuard, PROT_NONE);
    n_stacks_ = n;
  }

  void run_grid(const uint32_t groups[3], int nthreads, size_t smem_bytes) {
    if (nthreads <= 0 || nthreads % kSimdWidth || nthreads > kMaxThreads)
      throw Error("emulator: threads per group must be a positive multiple of 32, at most 1024; got %d",
                  nthreads);
    n_ = nthreads;
    ensure_stacks(n_);
    if (smem_bytes + 16 > smem_cap_) {
      std::free(smem_);
      smem_cap_ = smem_bytes + 16;
      smem_ = static_cast<char*>(std::malloc(smem_cap_));
    }
    smem_size_ = smem_bytes + 16;
    for (uint32_t z = 0; z < groups[2]; ++z)
      for (uint32_t y = 0; y < groups[1]; ++y)
        for (uint32_t x = 0; x < groups[0]; ++x) run_group(groups, x, y, z);
  }

  void run_group(const uint32_t groups[3], uint32_t x, uint32_t y, uint32_t z) {
    std::memset(smem_, 0xFF, smem_size_);  // uninitialised threadgroup memory reads as NaN
    bar_arrived_ = 0;
    done_ = 0;
    error_[0] = 0;
    for (auto& s : slots_) s.arrived = 0;
    for (int t = 0; t < n_; ++t) {
      ThreadCtx& c = ctx_[t];
      c.tg[0] = x, c.tg[1] = y, c.tg[2] = z;
      for (int d = 0; d < 3; ++d) c.groups[d] = groups[d];
      c.tid = t, c.lane = t % kSimdWidth, c.sg = t / kSimdWidth;
      c.nsg = n_ / kSimdWidth, c.nthreads = n_;
      c.smem = smem_;
      st_[t] = kReady;
      prepare(t);
    }
    // Fibers hand over to each other; control comes back here only when none is ready.
    cur_ = 0;
    resume(0);
    if (error_[0]) throw Error("threadgroup (%u,%u,%u): %s", x, y, z, error_);
    if (done_ != n_) {
      diagnose();
      throw Error("threadgroup (%u,%u,%u): %s", x, y, z, error_);
    }
  }

  // Nobody can run: say which synchronisation point was reached by only part of its threads.
  void diagnose() {
    int at_bar = 0, first_done = -1;
    for (int t = 0; t < n_; ++t) {
      at_bar += st_[t] == kBarrier;
      if (st_[t] == kDone && first_done < 0) first_done = t;
    }
    for (int g = 0; g < n_ / kSimdWidth; ++g) {
      const Slot& s = slots_[g];
      if (s.arrived == 0) continue;
      int lane_done = -1, lane_bar = -1;
      for (int l = 0; l < kSimdWidth; ++l) {
        const State st = st_[g * kSimdWidth + l];
        if (st == kDone && lane_done < 0) lane_done = l;
        if (st == kBarrier && lane_bar < 0) lane_bar = l;
      }
      const int k = std::snprintf(error_, sizeof error_,
                                  "partial simdgroup collective: %s at line %d called by only %d of 32 lanes "
                                  "of simdgroup %d", s.what, s.line, s.arrived, g);
      if (lane_done >= 0)
        std::snprintf(error_ + k, sizeof error_ - k, "; lane %d returned before it", lane_done);
      else if (lane_bar >= 0)
        std::snprintf(error_ + k, sizeof error_ - k, "; lane %d waits at a barrier instead", lane_bar);
      return;
    }
    if (at_bar > 0) {
      const int k = std::snprintf(error_, sizeof error_,
                                  "partial barrier: %s at line %d reached by only %d of %d threads", bar_what_,
                                  bar_line_, at_bar, n_);
      if (first_done >= 0)
        std::snprintf(error_ + k, sizeof error_ - k, "; thread %d returned before it", first_done);
      return;
    }
    std::snprintf(error_, sizeof error_, "deadlock with no thread at a synchronisation point");
  }

  void (*body_)(void*, const ThreadCtx&) = nullptr;
  void* user_ = nullptr;
  int n_ = 0, cur_ = 0, done_ = 0, bar_arrived_ = 0, bar_line_ = 0;
  const char* bar_what_ = "";
  long barrier_waits_ = 0;
  State st_[kMaxThreads];
  ThreadCtx ctx_[kMaxThreads];
  Slot slots_[kMaxThreads / kSimdWidth];
  char* smem_ = nullptr;
  size_t smem_cap_ = 0, smem_size_ = 0;
  char error_[512];
  void* stacks_ = nullptr;
  size_t stacks_bytes_ = 0;
  int n_stacks_ = 0;
};

// This thread's runner (a Runner is not thread-safe, see above): the emulated Metal and SYCL
// devices share one shared object, and a dispatch on each from two threads must not meet.
inline Runner& runner() {
  static thread_local Runner r;
  return r;
}

// ---- collective operations shared by the Metal shim and the SYCL emulation ----
// Reductions fold a fixed tree (16-8-4-2-1, lane l += lane l + w) and broadcast one result, so
// every lane sees the same bits and the order depends on lane positions only.
template <class T, class Op>
inline void fold_bcast(Runner::Slot& s, Op op) {
  T v[kSimdWidth];
  for (int l = 0; l < kSimdWidth; ++l) std::memcpy(&v[l], s.in[l], sizeof(T));
  for (int w = kSimdWidth / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) v[l] = op(v[l], v[l + w]);
  for (int l = 0; l < kSimdWidth; ++l) std::memcpy(s.out[l], &v[0], sizeof(T));
}
template <class T> struct Ops {
  static void sum(Runner::Slot& s) { fold_bcast<T>(s, [](T a, T b) { return T(a + b); }); }
  static void max(Runner::Slot& s) { fold_bcast<T>(s, [](T a, T b) { return a < b ? b : a; }); }
  static void min(Runner::Slot& s) { fold_bcast<T>(s, [](T a, T b) { return b < a ? b : a; }); }
  // out[l] = in[arg[l]] (shuffle / broadcast) or in[l ^ arg[l]] (xor).
  static void shuffle(Runner::Slot& s) {
    for (int l = 0; l < kSimdWidth; ++l) std::memcpy(s.out[l], s.in[s.arg[l] & (kSimdWidth - 1)], sizeof(T));
  }
  static void shuffle_xor(Runner::Slot& s) {
    for (int l = 0; l < kSimdWidth; ++l) std::memcpy(s.out[l], s.in[(l ^ s.arg[l]) & (kSimdWidth - 1)], sizeof(T));
  }
};

}  // namespace swemu

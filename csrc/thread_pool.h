// A small persistent thread pool. Jobs are independent; which thread runs a job never changes
// its result (every kernel's reductions run in an order fixed by positions and dims only).
#pragma once
#include <functional>

#include <type_traits>

namespace sapwood {

// A non-owning reference to a callable `void(int)`, valid while the callable lives (a region's
// lambda outlives its parallel_for). A std::function made from a kernel's [&] lambda (more
// than two captures) allocated on the heap at every region: malloc and free were a visible
// share of a draft model's rows in perf.
class JobRef {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, JobRef>>>
  JobRef(F&& f)  // NOLINT: implicit, as std::function's
      : obj_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o, int i) { (*static_cast<std::remove_reference_t<F>*>(o))(i); }) {}
  void operator()(int i) const { call_(obj_, i); }

 private:
  void* obj_;
  void (*call_)(void*, int);
};

// Runs fn(0..n-1) on up to `threads` threads (0 = default_threads()); returns when all are done.
void parallel_for(int n, int threads, JobRef fn);
int default_threads();

// One background task at a time on a pool worker, for work the caller does not wait on (an
// engine folding its committed GDN steps while the caller drafts on its own thread).
// start_background returns false, running nothing, when the pool has no worker; it waits
// for a previous task first. Parallel regions wait for a running task before they start (its
// worker is theirs too). wait_background waits for the current task, if any, and rethrows
// an exception it raised. The task runs its own kernels on one thread (a region of its own
// would wait for itself).
bool start_background(std::function<void()> fn);
void wait_background();
void set_default_threads(int threads);

// The thread count for a region of about `work` multiply-adds (or element updates): 1 below
// min_parallel_work() (default 2^15), where handing jobs to a helper costs more than it saves.
// Within a forward the helper is still spinning from the previous region, so a hand-off is
// cheap: a one-token verify of the bundled 11M target is faster at thresholds around the
// default than at 2^20. Thread counts never change results; tests set the threshold to 0 so
// every region runs its parallel path.
long long min_parallel_work();
void set_min_parallel_work(long long work);
inline int threads_for(long long work, int threads) {
  return work < min_parallel_work() ? 1 : threads;
}

}  // namespace sapwood

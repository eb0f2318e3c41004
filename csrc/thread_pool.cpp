#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <pthread.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SW_PAUSE() _mm_pause()
#else
#define SW_PAUSE() std::this_thread::yield()
#endif

namespace sapwood {
namespace {

// Workers and the caller spin for a while (kSpin) before sleeping: a decode step issues dozens
// of parallel regions with serial work between them, and waking a sleeping thread through the
// kernel costs tens of microseconds in a VM, more than most regions' work. The spin is timed,
// not counted, because the cost of `pause` varies tenfold between CPUs. Past it they block, so
// an idle engine or a loaded machine (more runnable threads than cores) is not made worse.
// The spin outlasts the gaps of a decoding loop (the Python of a round; a draft model's
// single-threaded rows): with a shorter spin the helper slept in them, and in a VM a parked
// vCPU then takes several rounds to come back to speed, which costs more than the spinning.
constexpr auto kSpin = std::chrono::microseconds(2000);

// Spins until ready() or kSpin has passed; returns ready().
template <class Ready>
bool spin_until(Ready ready) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      SW_PAUSE();
    }
    if (std::chrono::steady_clock::now() >= until) return ready();
  }
}

class Pool {
 public:
  explicit Pool(int n) : ranges_(size_t(n) + 1) {
    for (int i = 0; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
  }
  ~Pool() {
    wait_idle();
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return int(workers_.size()); }

  // fork() (fork_prepare and after_fork_* below): the forking thread holds run_mu_ across the
  // fork, so no region or background task starts, and waits for a running background task
  // first: its engine's caller has gone on, and a child copying a half-folded GDN state would
  // compute from it. Regions of other threads end by themselves; their engines stay claimed
  // in the child (EngineBusy there), as their state is mid-call.
  void lock_for_fork() {
    run_mu_.lock();
    wait_idle();
  }
  void unlock_after_fork() { run_mu_.unlock(); }
  std::exception_ptr take_background_error() {  // the child's: no worker can hold mu_ now
    std::exception_ptr e;
    std::swap(e, bg_error_);
    return e;
  }
  Pool* older_abandoned = nullptr;  // after_fork_child's list

  bool start_background(std::function<void()> fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    if (workers_.empty()) return false;
    wait_idle();
    bg_fn_ = std::move(fn);
    {
      std::lock_guard<std::mutex> lk(mu_);
      bg_busy_.store(true);
    }
    if (sleepers_.load() > 0) cv_.notify_all();
    return true;
  }
  void wait_background() {
    wait_idle();
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lk(mu_);
      std::swap(e, bg_error_);
    }
    if (e) std::rethrow_exception(e);
  }

  // The caller thread takes part, so `helpers` workers join it.
  void run(int n, int helpers, JobRef fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);  // one parallel region at a time
    wait_idle();  // worker 0 may be running a background task
    fn_ = &fn;  // lives until run() returns, after every job has run
    helpers_ = helpers;
    total_ = n;
    error_ = nullptr;
    const int parts = helpers + 1;  // participant 0 is the caller, p > 0 is worker p - 1
    done_.store(0);
    for (int p = 0; p < parts; ++p)
      ranges_[p].set(int(int64_t(n) * p / parts), int(int64_t(n) * (p + 1) / parts));
    {
      std::lock_guard<std::mutex> lk(mu_);
      generation_.fetch_add(1);
    }
    if (sleepers_.load() > 0) cv_.notify_all();
    // The caller waits for the jobs, not for the helpers: a helper the OS has not run yet
    // (another process holds its core) finds its range taken by the caller and nothing to do,
    // instead of the region waiting a whole time slice for it to wake up and say so.
    work(0);
    if (!spin_until([&] { return done_.load() == n; })) {
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, [&] { return done_.load() == n; });
    }
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // A participant's jobs [lo, hi), packed in one word: its owner takes from the front, a
  // participant that ran out of its own takes from the back. One shared job counter made
  // every claim move a cache line between the cores (a verify claims hundreds of jobs in
  // dozens of regions); an owner's claims on its own line stay in its cache, and only a
  // region's last jobs move.
  struct alignas(64) JobRange {
    std::atomic<uint64_t> lo_hi{0};
    void set(int lo, int hi) { lo_hi.store(uint64_t(uint32_t(hi)) << 32 | uint32_t(lo)); }
    int take(bool front) {  // a job index, or -1 when none is left
      uint64_t v = lo_hi.load();
      for (;;) {
        const uint32_t lo = uint32_t(v), hi = uint32_t(v >> 32);
        if (lo >= hi) return -1;
        const uint64_t next = front ? uint64_t(hi) << 32 | (lo + 1) : uint64_t(hi - 1) << 32 | lo;
        if (lo_hi.compare_exchange_weak(v, next)) return int(front ? lo : hi - 1);
      }
    }
  };

  // Runs jobs until none is left, its own range first; returns how many it ran, which it
  // adds to done_ once (a shared counter per job would move its cache line at every claim).
  void work(int self) {
    const int parts = helpers_ + 1;
    int ran = 0;
    for (int k = 0; k < parts; ++k) {
      JobRange& r = ranges_[(self + k) % parts];
      for (int i; (i = r.take(/*front=*/k == 0)) >= 0; ++ran) {
        try {
          (*fn_)(i);
        } catch (...) {
          std::lock_guard<std::mutex> lk(mu_);
          if (!error_) error_ = std::current_exception();
        }
      }
    }
    if (ran > 0 && done_.fetch_add(ran) + ran == total_ && self != 0) {
      { std::lock_guard<std::mutex> lk(mu_); }  // the caller is waiting or will see it done
      done_cv_.notify_all();
    }
  }
  void wait_idle() {  // until no background task runs
    if (!spin_until([&] { return !bg_busy_.load(); })) {
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, [&] { return !bg_busy_.load(); });
    }
  }
  void loop(int index) {
    uint64_t seen = 0;  // the generation at construction: a region may start before we run
    // worker 0 also takes the background task
    auto ready = [&] { return generation_.load() != seen || (index == 0 && bg_busy_.load()); };
    for (;;) {
      if (!spin_until(ready)) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1);
        cv_.wait(lk, ready);
        sleepers_.fetch_sub(1);
      }
      if (index == 0 && bg_busy_.load()) {
        std::exception_ptr e;
        try {
          bg_fn_();
        } catch (...) {
          e = std::current_exception();
        }
        bg_fn_ = nullptr;
        {
          std::lock_guard<std::mutex> lk(mu_);
          if (e) bg_error_ = e;
          bg_busy_.store(false);
        }
        done_cv_.notify_all();
        continue;
      }
      seen = generation_.load();
      if (stop_) return;
      if (index < helpers_) work(index + 1);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  const JobRef* fn_ = nullptr;
  std::atomic<int> helpers_{0};  // read by a helper that wakes after its region is over
  std::vector<JobRange> ranges_;  // one a participant: the caller and each worker
  std::atomic<int> done_{0}, sleepers_{0};  // jobs of this region run so far
  int total_ = 0;
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  std::exception_ptr error_;
  std::function<void()> bg_fn_;      // the background task, while bg_busy_
  std::atomic<bool> bg_busy_{false};
  std::exception_ptr bg_error_;      // what it raised, until wait_background()
};

std::atomic<int> g_default_threads{0};
std::atomic<long long> g_min_parallel_work{1LL << 15};

int hardware_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

// The pool, made at first use. A child of fork() has only the forking thread: the workers of
// the pool it copied do not exist, so a region whose jobs a worker had taken, or a background
// task (Engine::commit's fold, which no caller-side work stands in for), waited forever
// (issue 50: generate() in a child never returned). The child abandons that pool (its mutexes
// and threads are not safe to touch, let alone join) and makes a new one at its next region.
std::mutex g_pool_mu;               // makes the pool; held across fork()
std::atomic<Pool*> g_pool{nullptr};
Pool* g_abandoned = nullptr;        // the child's copy of its parent's pool, never freed
std::exception_ptr g_fork_error;    // a background error the abandoned pool held (g_pool_mu)
std::atomic<bool> g_fork_error_set{false};

void fork_prepare() {
  g_pool_mu.lock();
  if (Pool* p = g_pool.load()) p->lock_for_fork();
}

void after_fork_parent() {
  if (Pool* p = g_pool.load()) p->unlock_after_fork();
  g_pool_mu.unlock();
}

void after_fork_child() {
  if (Pool* p = g_pool.exchange(nullptr)) {
    g_fork_error = p->take_background_error();  // the fold's error, for the engine's next call
    g_fork_error_set.store(bool(g_fork_error));
    p->older_abandoned = g_abandoned;  // a grandchild's list: still referenced, so a leak
    g_abandoned = p;                   // checker sees no leak
  }
  g_pool_mu.unlock();
}

// Joins the workers at exit, as the pool did when it was a static object.
struct PoolOwner {
  ~PoolOwner() {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    delete g_pool.exchange(nullptr);
  }
} g_pool_owner;

Pool& pool() {
  if (Pool* p = g_pool.load(std::memory_order_acquire)) return *p;
  std::lock_guard<std::mutex> lk(g_pool_mu);
  Pool* p = g_pool.load(std::memory_order_relaxed);
  if (!p) {
    static const bool registered = pthread_atfork(fork_prepare, after_fork_parent,
                                                  after_fork_child) == 0;
    (void)registered;
    p = new Pool(std::max(0, hardware_threads() - 1));
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

}  // namespace

int default_threads() {
  int t = g_default_threads.load();
  return t > 0 ? t : hardware_threads();
}

void set_default_threads(int threads) { g_default_threads.store(threads > 0 ? threads : 0); }

long long min_parallel_work() { return g_min_parallel_work.load(std::memory_order_relaxed); }
void set_min_parallel_work(long long work) { g_min_parallel_work.store(work < 0 ? 0 : work); }

bool start_background(std::function<void()> fn) { return pool().start_background(std::move(fn)); }
void wait_background() {
  pool().wait_background();
  if (g_fork_error_set.load()) {  // only in a child whose parent forked past a failed task
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lk(g_pool_mu);
      std::swap(e, g_fork_error);
      g_fork_error_set.store(false);
    }
    if (e) std::rethrow_exception(e);
  }
}

void parallel_for(int n, int threads, JobRef fn) {
  if (n <= 0) return;
  if (threads <= 0) threads = default_threads();
  Pool& p = pool();
  int helpers = std::min({threads - 1, n - 1, p.size()});
  if (helpers <= 0) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  p.run(n, helpers, fn);
}

}  // namespace sapwood

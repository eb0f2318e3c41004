#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace sapwood {
namespace {

class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return int(workers_.size()); }

  // The caller thread takes part, so `helpers` workers join it.
  void run(int n, int helpers, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);  // one parallel region at a time
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      active_ = helpers;
      helpers_ = helpers;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    for (int i; (i = next_.fetch_add(1)) < n_;) {
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }
  void loop() {
    uint64_t seen = 0;
    int index = slot_.fetch_add(1);
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (generation_ != seen && index < helpers_); });
        if (stop_) return;
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> lk(mu_);
      if (--active_ == 0) done_cv_.notify_all();
    }
  }
  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0, active_ = 0, helpers_ = 0;
  std::atomic<int> next_{0}, slot_{0};
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

std::atomic<int> g_default_threads{0};

int hardware_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

Pool& pool() {
  static Pool p(std::max(0, hardware_threads() - 1));
  return p;
}

}  // namespace

int default_threads() {
  int t = g_default_threads.load();
  return t > 0 ? t : hardware_threads();
}

void set_default_threads(int threads) { g_default_threads.store(threads > 0 ? threads : 0); }

void parallel_for(int n, int threads, const std::function<void(int)>& fn) {
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

// A small persistent thread pool. Jobs are independent; which thread runs a job never changes
// its result (every kernel's reductions run in an order fixed by positions and dims only).
#pragma once
#include <functional>

namespace sapwood {

// Runs fn(0..n-1) on up to `threads` threads (0 = default_threads()); returns when all are done.
void parallel_for(int n, int threads, const std::function<void(int)>& fn);
int default_threads();
void set_default_threads(int threads);

}  // namespace sapwood

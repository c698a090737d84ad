#include "thread_pool.h"

#include <immintrin.h>

namespace mlxkv {

namespace {
constexpr int kSpins = 20000;  // ~50-100 us of pause before a worker sleeps
}

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run(const std::function<void(int)>& task) {
  if (workers_.empty()) {
    task(0);
    return;
  }
  task_ = &task;
  pending_.store(int(workers_.size()), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  task(0);
  while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  while (true) {
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && spins < kSpins) {
      _mm_pause();
      ++spins;
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    (*task_)(index);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace mlxkv

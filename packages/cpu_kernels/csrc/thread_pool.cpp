#include "thread_pool.h"

#include <immintrin.h>

#include <stdexcept>

namespace mlxkv {

namespace {
constexpr int kSpins = 2000;  // ~50 us of pause (~25 ns each here) before a worker sleeps
constexpr uint64_t kMask24 = (1u << 24) - 1;

uint64_t pack(uint64_t gen, uint64_t total, uint64_t next) { return (gen & 0xffff) << 48 | total << 24 | next; }
}  // namespace

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
    wakeups_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run(int64_t total, const std::function<void(int64_t, int)>& task) {
  if (total <= 0) return;
  if (uint64_t(total) > kMask24) throw std::invalid_argument("too many chunks for the thread pool");
  uint64_t gen = (job_.load() >> 48) + 1;
  task_ = &task;
  done_.store(0, std::memory_order_relaxed);
  job_.store(pack(gen, uint64_t(total), 0), std::memory_order_release);
  if (!workers_.empty()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      wakeups_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
  }
  work(0);
  while (done_.load(std::memory_order_acquire) != total) _mm_pause();
}

void ThreadPool::work(int index) {
  uint64_t job = job_.load(std::memory_order_acquire);
  while (true) {
    uint64_t total = (job >> 24) & kMask24, next = job & kMask24;
    if (next >= total) return;
    if (job_.compare_exchange_weak(job, job + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      // The job cannot end before this chunk is counted done, so task_ is still this job's.
      (*task_)(int64_t(next), index);
      done_.fetch_add(1, std::memory_order_acq_rel);
      job = job_.load(std::memory_order_acquire);
    }
  }
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  while (true) {
    int spins = 0;
    while (wakeups_.load(std::memory_order_acquire) == seen && spins < kSpins) {
      _mm_pause();
      ++spins;
    }
    if (wakeups_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return wakeups_.load() != seen; });
    }
    seen = wakeups_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    work(index);
  }
}

}  // namespace mlxkv

// A persistent pool: run(n, f) calls f(0..n-1) on n threads (the caller is thread 0) and returns
// when all are done. Workers spin briefly before sleeping, since a decode step issues hundreds of
// small matmuls and a condition-variable wake-up per call would cost more than the work.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mlxkv {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }
  void run(const std::function<void(int)>& task);

 private:
  void worker(int index);

  std::vector<std::thread> workers_;
  const std::function<void(int)>* task_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace mlxkv

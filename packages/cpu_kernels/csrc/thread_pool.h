// A persistent pool that shares out `total` chunks of one job: run(total, f) calls f(chunk, thread)
// once per chunk and returns when all are done. The caller works too and claims chunks like any
// worker, so a worker that is slow to wake (a busy machine) costs nothing: the caller only waits
// for chunks a worker has actually claimed. Workers spin briefly before sleeping, since a decode
// step issues hundreds of small products.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
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
  void run(int64_t total, const std::function<void(int64_t, int)>& task);

 private:
  void worker(int index);
  void work(int index);

  std::vector<std::thread> workers_;
  // The job word: generation (16 bits) | total chunks (24 bits) | next chunk (24 bits). A chunk is
  // claimed by a compare-and-swap on it, so a late worker can never claim a chunk of a later job.
  std::atomic<uint64_t> job_{0};
  std::atomic<int64_t> done_{0};
  const std::function<void(int64_t, int)>* task_ = nullptr;
  std::atomic<uint64_t> wakeups_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace mlxkv

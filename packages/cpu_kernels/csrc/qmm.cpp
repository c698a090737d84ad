#include "qmm.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "thread_pool.h"

namespace mlxkv {

namespace {

// Rows per block: the block of x stays in L2 while each thread walks its columns.
constexpr int64_t kRowBlock = 64;
// Columns per thread are multiples of this, so panels are whole.
constexpr int64_t kColAlign = 16;
// Rows up to which every thread permutes x itself, into its own buffer, on claiming its first chunk
// of a product: in parallel, not on the caller before the job, and without reading the lines the
// caller's core just wrote (standalone, an 8-row decode step's products: -7%, one row -3%). More
// rows are permuted once by the caller, for all.
constexpr int64_t kOwnXRows = 16;
// Multiply-adds a chunk must hold to be worth a claim of its own once every thread has one.
constexpr int64_t kMinChunkWork = int64_t(1) << 20;
// Multiply-adds below which one thread does the whole job (a lone 192 x 576 GEMV, the size of the
// embedded model's k and v projections): waking a worker costs more than the work. Above it every
// thread gets a chunk: a one-row product streams its weights from memory, and two cores streaming halves beat one
// streaming all (standalone, a lone decode step's products: 9.8 ms with only the lm_head split,
// 6.6 ms with this; 8 rows 16.8 -> 16.5 ms).
constexpr int64_t kMinSplitWork = int64_t(1) << 17;

int default_threads() {
  if (const char* env = std::getenv("MLXKV_CPU_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : int(hw);
}

bool cpu_has(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default:
      return true;
  }
}

// The pool mutex also serialises products: set_num_threads waits for a running one.
std::mutex pool_mutex;
std::unique_ptr<ThreadPool> pool;
// Cache-line aligned floats: with rows a multiple of 32 floats long, no vector load of x or of a
// panel straddles two lines (malloc's 16-byte alignment split every other AVX2 load of x; aligning
// x made an 8-row AVX2 tile ~25% faster standalone).
template <class T>
struct LineAligned {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
using Floats = std::vector<float, LineAligned<float>>;

std::vector<Floats> panels;
std::vector<Floats> x_permuted;  // per thread where each permutes x itself, else [0] for all
std::vector<uint8_t> x_ready;  // per thread: its x_permuted holds this product's x
Isa selected = best_isa();

ThreadPool& get_pool() {
  if (!pool) pool = std::make_unique<ThreadPool>(default_threads());
  return *pool;
}

}  // namespace

Isa best_isa() {
  if (cpu_has(Isa::avx512)) return Isa::avx512;
  if (cpu_has(Isa::avx2)) return Isa::avx2;
  return Isa::generic;
}

Isa current_isa() { return selected; }

void set_isa(Isa isa) {
  if (!cpu_has(isa)) throw std::invalid_argument(std::string("this CPU does not support ") + isa_name(isa));
  std::lock_guard<std::mutex> lock(pool_mutex);
  selected = isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

int num_threads() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  return get_pool().size();
}

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("thread count must be >= 1, got " + std::to_string(n));
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool.reset();
  pool = std::make_unique<ThreadPool>(n);
}

void pool_run(const std::function<int64_t(int)>& plan, const std::function<void(int64_t, int)>& task) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  ThreadPool& tp = get_pool();
  const int64_t total = plan(tp.size());
  if (total == 1) {
    task(0, 0);
  } else if (total > 1) {
    tp.run(total, task);
  }
}

namespace {

// Each block of 32 floats of every row of x becomes its 16 even then its 16 odd elements: the
// order the packed codes unpack in (see qmm.h). Once per product and thread (up to kOwnXRows
// rows) or once for all, and shared by all columns.
void permute_x(const QmmArgs& a, float* dst) {
  for (int64_t m = 0; m < a.M; ++m) {
    const float* src = a.x + m * a.K;
    float* out = dst + m * a.K;
    for (int64_t k = 0; k < a.K; k += 32) {
      for (int i = 0; i < 16; ++i) {
        out[k + i] = src[k + 2 * i];
        out[k + 16 + i] = src[k + 2 * i + 1];
      }
    }
  }
}

}  // namespace

void qmm_run(const QmmArgs* products, int count) {
  if (count <= 0) return;
  std::lock_guard<std::mutex> lock(pool_mutex);
  ThreadPool& tp = get_pool();
  const QmmArgs& first = products[0];
  const bool own_x = first.M <= kOwnXRows;
  if (int(x_permuted.size()) < tp.size()) x_permuted.resize(tp.size());
  for (int t = 0; t < (own_x ? tp.size() : 1); ++t) {
    if (int64_t(x_permuted[t].size()) < first.M * first.K) x_permuted[t].resize(first.M * first.K);
  }
  x_ready.assign(tp.size(), 0);
  if (!own_x) permute_x(first, x_permuted[0].data());
  auto range = for_isa(qmm_range_avx512, qmm_range_avx2, qmm_range_generic);
  // Chunks of whole columns over the products laid end to end (product i's slices follow product
  // i - 1's): the split changes which thread computes an element, never how. About 4 chunks a
  // thread balances load; at least kColAlign columns and kMinChunkWork multiply-adds keep chunks
  // worth a claim, but from kMinSplitWork on every thread has one.
  std::vector<int64_t> slice_end(static_cast<size_t>(count));
  int64_t slices = 0, columns = 0;
  for (int i = 0; i < count; ++i) {
    slices += (products[i].N + kColAlign - 1) / kColAlign;
    slice_end[size_t(i)] = slices;
    columns += products[i].N;
  }
  const int64_t work = first.M * columns * first.K;
  int64_t chunks = std::max<int64_t>(1, std::min({slices, int64_t(4) * tp.size(), work / kMinChunkWork}));
  if (work >= kMinSplitWork) chunks = std::max<int64_t>(chunks, std::min<int64_t>(slices, tp.size()));
  // Past one chunk a thread, whole rounds of chunks: threads claim them as they finish, so 3 on 2
  // threads left one doing two while the other waited (a 2-row step's gate and up, 3.5M
  // multiply-adds; `tools.bench_kernel --step-rows 1-10 --head-bits 8`, 2 threads, alternating:
  // 2-4, 6, 7 and 10 rows' products 3.5-7% faster, the others unchanged).
  if (chunks > tp.size()) chunks = std::min<int64_t>(slices, (chunks + tp.size() - 1) / tp.size() * tp.size());
  if (int(panels.size()) < tp.size()) panels.resize(tp.size());
  for (auto& panel : panels) {
    if (int64_t(panel.size()) < kPanelCols * first.K) panel.resize(kPanelCols * first.K);
  }
  auto task = [&](int64_t chunk, int t) {
    const float* x = x_permuted[own_x ? t : 0].data();
    if (own_x && !x_ready[t]) {  // only thread t touches slot t
      permute_x(first, x_permuted[t].data());
      x_ready[t] = 1;
    }
    const int64_t s0 = slices * chunk / chunks, s1 = slices * (chunk + 1) / chunks;
    for (int i = 0; i < count; ++i) {
      const int64_t begin = i == 0 ? 0 : slice_end[size_t(i) - 1], end = slice_end[size_t(i)];
      if (end <= s0 || begin >= s1) continue;
      QmmArgs a = products[i];
      a.x = x;
      const int64_t n0 = std::min(a.N, (std::max(s0, begin) - begin) * kColAlign);
      const int64_t n1 = std::min(a.N, (std::min(s1, end) - begin) * kColAlign);
      for (int64_t m0 = 0; m0 < a.M; m0 += kRowBlock) {
        range(a, n0, n1, m0, std::min(a.M, m0 + kRowBlock), panels[t].data());
      }
    }
  };
  if (chunks == 1) {
    task(0, 0);
  } else {
    tp.run(chunks, task);
  }
}

}  // namespace mlxkv

#include "activations.h"

#include <algorithm>

#include "qmm.h"

namespace mlxkv {

namespace {

// Elements below which one thread does everything (a decode step's rows): waking a worker costs
// more than the work. Chunks are whole 16-lane blocks.
constexpr int64_t kMinParallel = int64_t(1) << 15;
constexpr int64_t kBlock = 16;

// Whole rows on the thread pool: row(r) for r in [0, rows), one thread below kMinParallel elements.
template <class Row>
void rows_run(int64_t rows, int64_t n, const Row& row) {
  int64_t chunks = 1;
  auto plan = [&](int threads) {
    if (rows * n >= kMinParallel) chunks = std::min<int64_t>(rows, threads);
    return rows == 0 || n == 0 ? 0 : chunks;
  };
  auto task = [&](int64_t chunk, int) {
    for (int64_t r = rows * chunk / chunks; r < rows * (chunk + 1) / chunks; ++r) row(r);
  };
  pool_run(plan, task);
}

// An elementwise kernel over all n elements on the thread pool, in chunks of whole 16-lane blocks.
void elementwise_run(void (*kernel)(const float*, const float*, float*, int64_t), const float* g, const float* u,
                     float* out, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  int64_t chunks = 1;
  auto plan = [&](int threads) {
    if (n >= kMinParallel) chunks = std::min<int64_t>(blocks, threads);
    return n == 0 ? 0 : chunks;
  };
  auto task = [&](int64_t chunk, int) {
    const int64_t i0 = std::min(n, blocks * chunk / chunks * kBlock);
    const int64_t i1 = std::min(n, blocks * (chunk + 1) / chunks * kBlock);
    kernel(g + i0, u + i0, out + i0, i1 - i0);
  };
  pool_run(plan, task);
}

}  // namespace

void swiglu_run(const float* g, const float* u, float* out, int64_t n) {
  elementwise_run(for_isa(swiglu_avx512, swiglu_avx2, swiglu_generic), g, u, out, n);
}

void geglu_run(const float* g, const float* u, float* out, int64_t n) {
  elementwise_run(for_isa(geglu_avx512, geglu_avx2, geglu_generic), g, u, out, n);
}

void log_softmax_run(const float* x, float* out, int64_t rows, int64_t n) {
  auto kernel = for_isa(log_softmax_avx512, log_softmax_avx2, log_softmax_generic);
  rows_run(rows, n, [&](int64_t r) { kernel(x + r * n, out + r * n, n); });
}

void rms_norm_run(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  auto kernel = for_isa(rms_norm_avx512, rms_norm_avx2, rms_norm_generic);
  rows_run(rows, n, [&](int64_t r) { kernel(x + r * n, w, out + r * n, n, eps); });
}

}  // namespace mlxkv

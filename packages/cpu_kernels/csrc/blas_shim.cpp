// cblas_sgemm with a fixed reduction order, exported into the global symbol scope ahead of libmlx
// (which otherwise binds its bundled reference BLAS, ~4 GFLOP/s). Every C[i, j] is reduced over K
// exactly as the native quantized kernel does (16 lanes, ascending k, fixed tree), so attention's
// q.k^T and p.v give the same bits whatever M, N or the query chunking: an optimized BLAS such as
// OpenBLAS picks kernels by shape and broke prefill-chunk and compiled-step exactness.
// No mlx, no Python: the loader must not import mlx before this library is loaded.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "blas_hook.h"
#include "qmm.h"

namespace {

enum { kRowMajor = 101, kColMajor = 102, kNoTrans = 111 };

using Dense = void (*)(const mlxkv::QmmArgs&, const float*, int64_t);
using Row = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, float*);

int best() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
    return 3;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 2;
  return 0;
}

const int isa = best();
const Dense dense = isa == 3 ? mlxkv::dense_avx512 : isa == 2 ? mlxkv::dense_avx2 : mlxkv::dense_generic;
const Row row = isa == 3 ? mlxkv::row_avx512 : isa == 2 ? mlxkv::row_avx2 : mlxkv::row_generic;

// Rows of A up to this with a row-major B skip packing: transposing B (a round's attention values,
// once per query head) cost more than reading it as it lies, row by row (`tools.bench_blas`).
constexpr int kRowPathMaxM = 16;

void store(float* c, int64_t ldc, int64_t m, int64_t n, const float* dots, float alpha, float beta) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float d = dots[i * n + j];
      float* out = c + i * ldc + j;
      *out = beta == 0.0f ? alpha * d : alpha * d + beta * *out;
    }
  }
}

// Edge of the square tiles a transposing pack copies: a tile's source rows and destination rows
// are each a cache line, where a column-by-column copy read a new line for every element (the
// values of a round's attention, packed once per query head: most of its cost).
constexpr int64_t kPackTile = 16;

// rows x k of op(src) into dst (rows, kp) zero-padded; trans: op(src)[r][c] = src[c * ld + r].
void pack(const float* src, int64_t ld, bool trans, int64_t rows, int64_t k, int64_t kp, float* dst) {
  if (trans) {
    for (int64_t c0 = 0; c0 < k; c0 += kPackTile) {
      const int64_t c1 = std::min(k, c0 + kPackTile);
      for (int64_t r0 = 0; r0 < rows; r0 += kPackTile) {
        const int64_t r1 = std::min(rows, r0 + kPackTile);
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) dst[r * kp + c] = src[c * ld + r];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = dst + r * kp;
    if (!trans) std::memcpy(out, src + r * ld, sizeof(float) * k);
    for (int64_t c = k; c < kp; ++c) out[c] = 0.0f;
  }
}

// The native kernels' thread pool, handed over by their extension when it loads
// (`mlxkv_blas_use_runner`); until then (or for small products) the caller computes every chunk.
std::atomic<MlxkvRunner> runner{nullptr};
std::atomic<bool> split{true};  // off: every product on the calling thread (tests compare the two)

// Multiply-adds from which a product is split into column slices (~20 us alone here): below it,
// handing a slice to a worker costs about what the slice saves.
constexpr int64_t kMinSplitWork = int64_t(1) << 18;

// A product whose operands are ready: rows of op(A) (packed or in place, K apart) and either
// N packed rows of op(B)^T (dense) or a row-major B (row path). Column slices are independent:
// a slice changes which thread computes an element, never how.
struct Product {
  const float* a_rows;
  int64_t lda_rows;  // distance between rows of a_rows
  const float* b;
  int64_t ldb;
  bool row_path;
  int64_t m, n, k;  // k: the padded K (dense) or K (row path)
  float alpha, beta;
  float* c;
  int64_t ldc;
  int64_t slices;
};

void run_slice(const Product& p, int64_t slice) {
  const int64_t n0 = p.n * slice / p.slices / 16 * 16;
  const int64_t n1 = slice + 1 == p.slices ? p.n : p.n * (slice + 1) / p.slices / 16 * 16;
  const int64_t cols = n1 - n0;
  if (cols <= 0) return;
  thread_local std::vector<float> dots, lanes;
  dots.resize(size_t(p.m) * cols);
  if (p.row_path) {
    lanes.resize(size_t(16) * cols);
    for (int64_t i = 0; i < p.m; ++i) row(p.a_rows + i * p.lda_rows, p.k, p.b + n0, p.ldb, cols, dots.data() + i * cols, lanes.data());
  } else {
    mlxkv::QmmArgs args{};
    args.x = p.a_rows;
    args.y = dots.data();
    args.M = p.m;
    args.N = cols;
    args.K = p.k;
    dense(args, p.b + n0 * p.ldb, p.ldb);
  }
  store(p.c + n0, p.ldc, p.m, cols, dots.data(), p.alpha, p.beta);
}

void run_product(Product& p) {
  const MlxkvRunner run = runner.load(std::memory_order_acquire);
  const int64_t work = p.m * p.n * p.k;
  p.slices = run == nullptr || !split.load(std::memory_order_relaxed) || work < kMinSplitWork ? 1 : std::min<int64_t>(p.n / 16, work < 4 * kMinSplitWork ? 2 : 4);
  if (p.slices <= 1) {
    p.slices = 1;
    run_slice(p, 0);
    return;
  }
  run(p.slices, [](void* ctx, int64_t slice) { run_slice(*static_cast<Product*>(ctx), slice); }, &p);
}

}  // namespace

extern "C" {

int mlxkv_blas_version() { return 2; }

// Called by mlxkv_cpu_kernels' extension as it loads: from then on large products run on its pool.
__attribute__((visibility("default"))) void mlxkv_blas_use_runner(MlxkvRunner run) { runner.store(run, std::memory_order_release); }

// Whether a pool has been handed over (`mlxkv_blas_use_runner`).
__attribute__((visibility("default"))) int mlxkv_blas_has_runner() { return runner.load() != nullptr ? 1 : 0; }

// Whether large products are split over the pool (default on); returns the previous setting.
__attribute__((visibility("default"))) int mlxkv_blas_set_split(int enabled) { return split.exchange(enabled != 0) ? 1 : 0; }

__attribute__((visibility("default"))) void cblas_sgemm(
    int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
    int ldb, float beta, float* c, int ldc) {
  if (order == kColMajor) {  // C^T = op(B)^T op(A)^T in row-major terms
    std::swap(a, b);
    std::swap(lda, ldb);
    std::swap(ta, tb);
    std::swap(m, n);
  }
  if (m <= 0 || n <= 0) return;
  thread_local std::vector<float> ap, bp;
  if (m <= kRowPathMaxM && tb == kNoTrans) {
    if (ta != kNoTrans) {  // rows of op(A) gathered once; a row-major A's rows are read in place
      ap.resize(size_t(m) * k);
      for (int64_t i = 0; i < m; ++i) pack(a + i, lda, true, 1, k, k, ap.data() + i * k);
    }
    Product p{ta == kNoTrans ? a : ap.data(), ta == kNoTrans ? lda : k, b, ldb, true, m, n, k, alpha, beta, c, ldc, 1};
    run_product(p);
    return;
  }
  const int64_t kp = (int64_t(k) + 15) / 16 * 16;
  // Operands already laid out as the kernel reads them (attention's q.k^T: q rows, k rows, head
  // dim a multiple of 16) are read in place: packing the keys was a copy of the cache per call.
  const bool a_in_place = ta == kNoTrans && kp == k && (m == 1 || lda == k);
  const bool b_in_place = tb != kNoTrans && kp == k;
  if (!a_in_place) {
    ap.resize(size_t(m) * kp);
    pack(a, lda, ta != kNoTrans, m, k, kp, ap.data());
  }
  if (!b_in_place) {
    bp.resize(size_t(n) * kp);
    // Rows of op(B)^T: op(B)^T[j][l] = op(B)[l][j]; for NoTrans that is b[l * ldb + j] (a transpose).
    pack(b, ldb, tb == kNoTrans, n, k, kp, bp.data());
  }
  Product p{a_in_place ? a : ap.data(), kp, b_in_place ? b : bp.data(), b_in_place ? ldb : kp, false, m, n, kp, alpha, beta, c, ldc, 1};
  run_product(p);
}

}  // extern "C"

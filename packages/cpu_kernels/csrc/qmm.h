// Batch-invariant affine-quantized matmul: y = x @ dequant(w)^T.
//
// Every output element y[m, n] is reduced in one fixed order, whatever M, the row tile, the
// thread count or the instruction set:
//   partial[l] = fma-chain over k = 2l, 2l + 1, 2l + 32, 2l + 33, ... (ascending) of x[m, k] * w[n, k]
//   y[m, n]    = the fixed 16 -> 8 -> 4 -> 2 -> 1 pairwise tree over partial[0..15]
// with w[n, k] = fma(q, scale, bias) rounded once to float32. Lane l takes the pair 2l, 2l + 1 of
// every block of 32 because that is how the codes lie packed (4-bit: one byte; 8-bit: one
// little-endian word): x is permuted to match before a product (by each thread for itself, or once
// for all; see qmm.cpp), so unpacking needs no shuffle. AVX-512 holds the 16 partials in one
// register, AVX2 in two, the portable path in an array: same operations, same bits.
#pragma once

#include <cstdint>
#include <functional>

namespace mlxkv {

struct QmmArgs {
  const float* x;         // (M, K) row-major
  const uint8_t* w;       // (N, K * bits / 8) packed, little-endian within each uint32
  const void* scales;     // (N, K / group_size), float32 or float16
  const void* biases;     // same shape and dtype as scales
  bool scales_f16;
  float* y;               // (M, N) row-major
  int64_t M, N, K;
  int group_size, bits;
};

enum class Isa : int { generic = 0, avx2 = 2, avx512 = 3 };

// Columns [n0, n1) for rows [m0, m1); `panel` holds kPanelCols * K floats.
constexpr int kPanelCols = 4;
void qmm_range_generic(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1, float* panel);
void qmm_range_avx2(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1, float* panel);
void qmm_range_avx512(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1, float* panel);

// Dense float product in a fixed order (lane l takes k = l, l + 16, ... ascending, then the same
// tree): a.x is (M, K) row-major and b_rows holds N rows of K floats, ldb apart, with K a multiple
// of 16 (zero-padded); writes a.y (M, N). Single-threaded.
void dense_generic(const QmmArgs& a, const float* b_rows, int64_t ldb);
void dense_avx2(const QmmArgs& a, const float* b_rows, int64_t ldb);
void dense_avx512(const QmmArgs& a, const float* b_rows, int64_t ldb);

// out (n) = a_row (k) times b, row-major (k, n) with leading dimension ldb, in the same order as
// dense_*; lanes holds 16 * n floats.
void row_generic(const float* a_row, int64_t k, const float* b, int64_t ldb, int64_t n, float* out, float* lanes);
void row_avx2(const float* a_row, int64_t k, const float* b, int64_t ldb, int64_t n, float* out, float* lanes);
void row_avx512(const float* a_row, int64_t k, const float* b, int64_t ldb, int64_t n, float* out, float* lanes);

// Runs `count` products of one x (same x, M, K, bits and group size; their own w, scales, biases,
// y and N) as one job on the thread pool with the selected instruction set: a layer's q, k and v
// projections, or its gate and up, cost one hand-off to the pool instead of one each. Every
// element is computed as it is alone, so the outputs are the bits of separate products.
void qmm_run(const QmmArgs* products, int count);

Isa best_isa();
Isa current_isa();
void set_isa(Isa isa);  // throws std::invalid_argument if this CPU lacks it
const char* isa_name(Isa isa);

// The copy of a per-instruction-set kernel (the *_isa.cpp translation units) that runs now.
template <class F>
F for_isa(F avx512, F avx2, F generic) {
  const Isa isa = current_isa();
  return isa == Isa::avx512 ? avx512 : isa == Isa::avx2 ? avx2 : generic;
}

int num_threads();
void set_num_threads(int n);

// Runs task(chunk, thread) for chunks 0..plan(pool size)-1 on the kernels' thread pool, one job
// at a time; plan also sizes the caller's per-thread scratch.
void pool_run(const std::function<int64_t(int)>& plan, const std::function<void(int64_t, int)>& task);

// Lets the BLAS shim, where it is loaded, run large float products on this pool (blas_runner.cpp).
void hand_pool_to_blas_shim();

}  // namespace mlxkv

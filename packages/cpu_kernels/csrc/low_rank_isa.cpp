// One instruction set's LoRA delta kernel (see low_rank.h); compiled three times like qmm_isa.cpp,
// with the same rule: an anonymous namespace and no std templates.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "low_rank.h"

#if QMM_ISA >= 2
#include <immintrin.h>
#endif

namespace mlxkv {
namespace {

#include "lanes.h"

constexpr int64_t kCols = 64;  // output columns per block: the 16 lanes of a block stay in L1

// out (n) = a_row (k) times b, row-major (k, n), ldb apart: lane l of column j chains the fma
// over k = l, l + 16, ... ascending, then the 16 -> 8 -> 4 -> 2 -> 1 tree. The order of
// qmm_isa.cpp's run_row (the BLAS shim's), column block by column block.
void row_times(const float* a_row, int64_t k, const float* b, int64_t ldb, int64_t n, float* out) {
  alignas(64) float lanes[16][kCols];
  for (int64_t j0 = 0; j0 < n; j0 += kCols) {
    const int64_t cols = n - j0 < kCols ? n - j0 : kCols;
    for (int l = 0; l < 16; ++l) {
      for (int64_t j = 0; j < cols; ++j) lanes[l][j] = 0.0f;
    }
    for (int64_t kk = 0; kk < k; ++kk) {
      float* acc = lanes[kk % 16];
      const float av = a_row[kk];
      const float* brow = b + kk * ldb + j0;
      for (int64_t j = 0; j < cols; ++j) acc[j] = std::fmaf(av, brow[j], acc[j]);
    }
    for (int step = 8; step >= 1; step /= 2) {
      for (int l = 0; l < step; ++l) {
        for (int64_t j = 0; j < cols; ++j) lanes[l][j] = lanes[l][j] + lanes[l + step][j];
      }
    }
    for (int64_t j = 0; j < cols; ++j) out[j0 + j] = lanes[0][j];
  }
}

// low (rank) = x (kp, zero-padded) times a, given as at: its rank columns as rows of kp floats
// (zero-padded): one 16-lane accumulator per column, k ascending, then reduce16. The lanes and
// their order of row_times (padding adds fma(0, 0, acc) = acc: a lane never holds -0).
void low_times(const float* x, const float* at, int64_t kp, int64_t rank, float* low) {
  for (int64_t j = 0; j < rank; ++j) {
    V16 acc = V16::zero();
    const float* column = at + j * kp;
    for (int64_t k0 = 0; k0 < kp; k0 += 16) acc = V16::fmadd(V16::load(x + k0), V16::load(column + k0), acc);
    low[j] = reduce16(acc);
  }
}

// out (n) = low (rank) times b (rank, n) row-major: 16 columns at a time, lane l in its own
// accumulator, then the tree across them; row_times' order. The last n % 16 columns by row_times.
void delta_times(const float* low, int64_t rank, const float* b, int64_t n, float* out) {
  int64_t j0 = 0;
  for (; j0 + 16 <= n; j0 += 16) {
    V16 acc[16];
    for (int l = 0; l < 16; ++l) acc[l] = V16::zero();
    for (int64_t kk = 0; kk < rank; ++kk) {
      acc[kk % 16] = V16::fmadd(V16::set1(low[kk]), V16::load(b + kk * n + j0), acc[kk % 16]);
    }
    for (int step = 8; step >= 1; step /= 2) {
      for (int l = 0; l < step; ++l) acc[l] = V16::add(acc[l], acc[l + step]);
    }
    acc[0].store(out + j0);
  }
  if (j0 < n) row_times(low, rank, b + j0, n, n - j0, out + j0);
}

void rows_delta(const float* x, int64_t K, float* y, int64_t N, const float* a_t, const float* b, int64_t rank,
                float scale, const int* rows, int64_t count, float* scratch) {
  if (count == 0) return;
  const int64_t kp = (K + 15) / 16 * 16;
  float *padded_a = scratch, *padded = padded_a + rank * kp, *low = padded + kp, *delta = low + rank;
  const float* at = a_t;  // read in place where its rows need no zero padding
  if (kp != K) {
    for (int64_t j = 0; j < rank; ++j) {
      for (int64_t k = 0; k < kp; ++k) padded_a[j * kp + k] = k < K ? a_t[j * K + k] : 0.0f;
    }
    at = padded_a;
  }
  for (int64_t k = K; k < kp; ++k) padded[k] = 0.0f;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = rows[i];
    const float* xr = x + r * K;
    if (kp != K) {
      for (int64_t k = 0; k < K; ++k) padded[k] = xr[k];
      xr = padded;
    }
    low_times(xr, at, kp, rank, low);
    delta_times(low, rank, b, N, delta);
    float* out = y + r * N;
    for (int64_t n = 0; n < N; ++n) {
      const float scaled = scale * delta[n];  // NOTE: two roundings, as MLX's multiply then add
      out[n] = out[n] + scaled;
    }
  }
}

}  // namespace

#if QMM_ISA == 3
void low_rank_avx512(const float* x, int64_t K, float* y, int64_t N, const float* a_t, const float* b, int64_t rank,
                     float scale, const int* rows, int64_t count, float* scratch) {
  rows_delta(x, K, y, N, a_t, b, rank, scale, rows, count, scratch);
}
#elif QMM_ISA == 2
void low_rank_avx2(const float* x, int64_t K, float* y, int64_t N, const float* a_t, const float* b, int64_t rank,
                   float scale, const int* rows, int64_t count, float* scratch) {
  rows_delta(x, K, y, N, a_t, b, rank, scale, rows, count, scratch);
}
#else
void low_rank_generic(const float* x, int64_t K, float* y, int64_t N, const float* a_t, const float* b, int64_t rank,
                      float scale, const int* rows, int64_t count, float* scratch) {
  rows_delta(x, K, y, N, a_t, b, rank, scale, rows, count, scratch);
}
#endif

}  // namespace mlxkv

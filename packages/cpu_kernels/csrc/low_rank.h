// A LoRA adapter's low-rank delta, added to some rows of a product's output:
//   y[r] = y[r] + scale * ((x[r] @ a) @ b)     a (K, rank), b (rank, N), float32
// a comes as a_t = a^T (rank, K) row-major (an adapter keeps it so: no transpose per call), b row-major.
// Each of the two products is reduced as the fixed-order cblas_sgemm (blas_shim.cpp) reduces
// it (16 lanes, ascending k, the fixed tree), the scale multiplies, then one add: exactly the
// MLX ops `y + scale * ((x @ a) @ b)` over the shim, a row's bits whatever the other rows.
#pragma once

#include <cstdint>

namespace mlxkv {

// One instruction set's copy (low_rank_isa.cpp); scratch holds (rank + 1) * kp + rank + N floats,
// kp = K rounded up to a multiple of 16.
void low_rank_avx512(const float* x, int64_t K, float* y, int64_t N, const float* a_t, const float* b, int64_t rank,
                     float scale, const int* rows, int64_t count, float* scratch);
void low_rank_avx2(const float* x, int64_t K, float* y, int64_t N, const float* a_t, const float* b, int64_t rank,
                   float scale, const int* rows, int64_t count, float* scratch);
void low_rank_generic(const float* x, int64_t K, float* y, int64_t N, const float* a_t, const float* b, int64_t rank,
                      float scale, const int* rows, int64_t count, float* scratch);

// Rows `rows[0..count)` of y (R, N) get the delta of x (R, K), with the selected instruction set
// on the calling thread (rank is small).
void low_rank_run(const float* x, int64_t K, float* y, int64_t N, const float* a_t, const float* b, int64_t rank,
                  float scale, const int* rows, int64_t count);

}  // namespace mlxkv

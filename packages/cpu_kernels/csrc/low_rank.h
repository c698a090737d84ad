// A LoRA adapter's low-rank delta, added to some rows of a product's output:
//   y[r] = y[r] + scale * ((x[r] @ a) @ b)     a (K, rank), b (rank, N), float32 row-major
// Each of the two products is reduced as the fixed-order cblas_sgemm (blas_shim.cpp) reduces
// it (16 lanes, ascending k, the fixed tree), the scale multiplies, then one add: exactly the
// MLX ops `y + scale * ((x @ a) @ b)` over the shim, a row's bits whatever the other rows.
#pragma once

#include <cstdint>

namespace mlxkv {

// Rows `rows[0..count)` of y (R, N) get the delta of x (R, K); single-threaded (rank is small).
void low_rank_run(const float* x, int64_t K, float* y, int64_t N, const float* a, const float* b, int64_t rank,
                  float scale, const int* rows, int64_t count);

}  // namespace mlxkv

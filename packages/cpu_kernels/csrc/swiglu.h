// SwiGLU's gate: out[i] = (g[i] * (1 / (1 + exp(-g[i])))) * u[i], elementwise in float32, with
// exp16's polynomial (exp16.h; its argument clamped to [-87, 88]): one rounding per operation, so
// every instruction set and thread count gives the same bits, and an element depends on its own
// two inputs alone (a row gets the same bits alone or in a batch).
#pragma once

#include <cstdint>

namespace mlxkv {

void swiglu_avx512(const float* g, const float* u, float* out, int64_t n);
void swiglu_avx2(const float* g, const float* u, float* out, int64_t n);
void swiglu_generic(const float* g, const float* u, float* out, int64_t n);

// All n elements on the thread pool with the selected instruction set.
void swiglu_run(const float* g, const float* u, float* out, int64_t n);

}  // namespace mlxkv

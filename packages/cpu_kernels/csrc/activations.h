// Float kernels built on exp16 (exp16.h), one rounding per operation, so every instruction set
// and thread count gives the same bits:
//   swiglu:      out[i] = (g[i] * (1 / (1 + exp(-g[i])))) * u[i], exp's argument clamped to
//                [-87, 88]; an element depends on its own two inputs alone.
//   geglu:       out[i] = (g / (1 + e * e)) * u[i], e = exp(-0.79788456 * fma(g * g * g, 0.044715, g)),
//                g = g[i], exp as above: the tanh-approximate GELU 0.5 * g * (1 + tanh(y)) =
//                g * sigmoid(2 * y), y = sqrt(2 / pi) * (g + 0.044715 * g^3), with no tanh and no
//                cancellation in 1 + tanh(y) for g < 0. Against MLX's float32 nn.gelu_approx(g) * u:
//                |out - mlx| <= 2^-21 * |g * u| + 2^-149 for every finite g (measured: 2.6e-7 * |g * u|;
//                up to 4 ulp where g > 0.5, up to 50 where g < 0 and MLX's 1 + tanh(y) cancels; both
//                stay within 1.4e-7 * |g| of the formula in float64); g very negative gives -0, as MLX does.
//   log_softmax: out[r, i] = x[r, i] - (m + log(s)), m = max of row r, s = reduce16 of 16 lane sums
//                of exp(x[r, t] - m), lane l adding the t with t % 16 == l in ascending order (the
//                sum softmax takes in attention.h); a row depends on itself alone.
//   exp:         out[i] = exp(x[i]) with x[i] clamped to [-87, 88] (exp16.h): the sampler's weights.
//   rms_norm:    out[r, i] = (x[r, i] * (1 / sqrt(s / n + eps))) * w[i], s = reduce16 of 16 lane sums
//                of x[r, t] * x[r, t], lane l fma-chaining the t with t % 16 == l in ascending order;
//                a row depends on itself (and w) alone.
#pragma once

#include <cstdint>

namespace mlxkv {

void swiglu_avx512(const float* g, const float* u, float* out, int64_t n);
void swiglu_avx2(const float* g, const float* u, float* out, int64_t n);
void swiglu_generic(const float* g, const float* u, float* out, int64_t n);

void geglu_avx512(const float* g, const float* u, float* out, int64_t n);
void geglu_avx2(const float* g, const float* u, float* out, int64_t n);
void geglu_generic(const float* g, const float* u, float* out, int64_t n);

void log_softmax_avx512(const float* x, float* out, int64_t n);
void log_softmax_avx2(const float* x, float* out, int64_t n);
void log_softmax_generic(const float* x, float* out, int64_t n);

void exp_avx512(const float* x, float* out, int64_t n);
void exp_avx2(const float* x, float* out, int64_t n);
void exp_generic(const float* x, float* out, int64_t n);

void rms_norm_avx512(const float* x, const float* w, float* out, int64_t n, float eps);
void rms_norm_avx2(const float* x, const float* w, float* out, int64_t n, float eps);
void rms_norm_generic(const float* x, const float* w, float* out, int64_t n, float eps);

// All n elements on the thread pool with the selected instruction set.
void swiglu_run(const float* g, const float* u, float* out, int64_t n);
void geglu_run(const float* g, const float* u, float* out, int64_t n);
// All rows (n elements each) on the thread pool with the selected instruction set.
void log_softmax_run(const float* x, float* out, int64_t rows, int64_t n);
// All rows (n elements each, w of n) on the thread pool with the selected instruction set.
void rms_norm_run(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps);

}  // namespace mlxkv

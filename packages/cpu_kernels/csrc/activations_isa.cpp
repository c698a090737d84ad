// One instruction set's activation kernels (see activations.h); compiled three times like qmm_isa.cpp, with the
// same rule: an anonymous namespace and no std templates.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "activations.h"

#if QMM_ISA >= 2
#include <immintrin.h>
#endif

namespace mlxkv {
namespace {

#include "lanes.h"
#include "exp16.h"

inline void swiglu16(const float* g, const float* u, float* out) {
  const V16 gate = V16::load(g), one = V16::set1(1.0f);
  float e[16];
  V16::mul(gate, V16::set1(-1.0f)).store(e);  // -g, exactly
  exp16(e, 0.0f, e);
  const V16 sigmoid = V16::div(one, V16::add(one, V16::load(e)));
  V16::mul(V16::mul(gate, sigmoid), V16::load(u)).store(out);
}

constexpr float kGeluCubic = 0.044715f;
constexpr float kSqrt2OverPi = 0.7978845608028654f;

// g * sigmoid(2 * y) * u: tanh-GELU's 0.5 * g * (1 + tanh(y)), as 1 + tanh(y) = 2 / (1 + exp(-y)^2).
// NOTE: exp(-y) squared rather than exp(-2 * y): exp16 clamps its argument at 88, so for a very
// negative g (y < -44) the square overflows to inf and the output is -0, as MLX's is.
inline void geglu16(const float* g, const float* u, float* out) {
  const V16 gate = V16::load(g);
  const V16 inner = V16::fmadd(V16::mul(V16::mul(gate, gate), gate), V16::set1(kGeluCubic), gate);
  float e[16];
  V16::mul(inner, V16::set1(-kSqrt2OverPi)).store(e);
  exp16(e, 0.0f, e);
  const V16 half = V16::load(e);
  V16::mul(V16::div(gate, V16::fmadd(half, half, V16::set1(1.0f))), V16::load(u)).store(out);
}

// out[i] = block(g, u)[i] over n elements, 16 at a time.
template <void (*block)(const float*, const float*, float*)>
void gated(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) block(g + i, u + i, out + i);
  if (i < n) {  // the tail through a zero-padded block: lanes never mix, so the same bits
    float gt[16] = {}, ut[16] = {}, ot[16];
    std::memcpy(gt, g + i, size_t(n - i) * sizeof(float));
    std::memcpy(ut, u + i, size_t(n - i) * sizeof(float));
    block(gt, ut, ot);
    std::memcpy(out + i, ot, size_t(n - i) * sizeof(float));
  }
}

// The largest of x[0..n): exact in any order.
inline float max_of(const float* x, int64_t n) {
  float top = x[0];
  for (int64_t t = 1; t < n; ++t) top = x[t] > top ? x[t] : top;
  return top;
}

void log_softmax(const float* x, float* out, int64_t n) {
  const float top = max_of(x, n);
  V16 sum = V16::zero();
  const V16 one = V16::set1(1.0f);
  float block[16];
  for (int64_t t = 0; t < n; t += 16) {
    const int64_t take = n - t < 16 ? n - t : 16;
    for (int64_t i = 0; i < 16; ++i) block[i] = i < take ? x[t + i] : top;
    exp16(block, top, block);
    for (int64_t i = take; i < 16; ++i) block[i] = 0.0f;
    sum.fma(V16::load(block), one);  // e * 1 + sum: exactly an add
  }
  const float lse = top + std::log(reduce16(sum));
  for (int64_t t = 0; t < n; ++t) out[t] = x[t] - lse;
}

void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  V16 sum = V16::zero();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const V16 v = V16::load(x + t);
    sum.fma(v, v);
  }
  if (t < n) {  // the tail zero-padded: 0 * 0 + s is s
    float tail[16] = {};
    std::memcpy(tail, x + t, size_t(n - t) * sizeof(float));
    const V16 v = V16::load(tail);
    sum.fma(v, v);
  }
  const float scale = 1.0f / std::sqrt(reduce16(sum) / float(n) + eps);
  const V16 s = V16::set1(scale);
  for (t = 0; t + 16 <= n; t += 16) V16::mul(V16::mul(V16::load(x + t), s), V16::load(w + t)).store(out + t);
  for (; t < n; ++t) out[t] = (x[t] * scale) * w[t];
}

void exp_all(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) exp16(x + i, 0.0f, out + i);
  if (i < n) {  // the tail through a zero-padded block, as in swiglu
    float xt[16] = {}, ot[16];
    std::memcpy(xt, x + i, size_t(n - i) * sizeof(float));
    exp16(xt, 0.0f, ot);
    std::memcpy(out + i, ot, size_t(n - i) * sizeof(float));
  }
}

}  // namespace

#if QMM_ISA == 3
void swiglu_avx512(const float* g, const float* u, float* out, int64_t n) { gated<swiglu16>(g, u, out, n); }
void geglu_avx512(const float* g, const float* u, float* out, int64_t n) { gated<geglu16>(g, u, out, n); }
void log_softmax_avx512(const float* x, float* out, int64_t n) { log_softmax(x, out, n); }
void exp_avx512(const float* x, float* out, int64_t n) { exp_all(x, out, n); }
void rms_norm_avx512(const float* x, const float* w, float* out, int64_t n, float eps) { rms_norm(x, w, out, n, eps); }
#elif QMM_ISA == 2
void swiglu_avx2(const float* g, const float* u, float* out, int64_t n) { gated<swiglu16>(g, u, out, n); }
void geglu_avx2(const float* g, const float* u, float* out, int64_t n) { gated<geglu16>(g, u, out, n); }
void log_softmax_avx2(const float* x, float* out, int64_t n) { log_softmax(x, out, n); }
void exp_avx2(const float* x, float* out, int64_t n) { exp_all(x, out, n); }
void rms_norm_avx2(const float* x, const float* w, float* out, int64_t n, float eps) { rms_norm(x, w, out, n, eps); }
#else
void swiglu_generic(const float* g, const float* u, float* out, int64_t n) { gated<swiglu16>(g, u, out, n); }
void geglu_generic(const float* g, const float* u, float* out, int64_t n) { gated<geglu16>(g, u, out, n); }
void log_softmax_generic(const float* x, float* out, int64_t n) { log_softmax(x, out, n); }
void exp_generic(const float* x, float* out, int64_t n) { exp_all(x, out, n); }
void rms_norm_generic(const float* x, const float* w, float* out, int64_t n, float eps) { rms_norm(x, w, out, n, eps); }
#endif

}  // namespace mlxkv

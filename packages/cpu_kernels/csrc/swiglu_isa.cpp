// One instruction set's SwiGLU (see swiglu.h); compiled three times like qmm_isa.cpp, with the
// same rule: an anonymous namespace and no std templates.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "swiglu.h"

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

void run(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) swiglu16(g + i, u + i, out + i);
  if (i < n) {  // the tail through a zero-padded block: lanes never mix, so the same bits
    float gt[16] = {}, ut[16] = {}, ot[16];
    std::memcpy(gt, g + i, size_t(n - i) * sizeof(float));
    std::memcpy(ut, u + i, size_t(n - i) * sizeof(float));
    swiglu16(gt, ut, ot);
    std::memcpy(out + i, ot, size_t(n - i) * sizeof(float));
  }
}

}  // namespace

#if QMM_ISA == 3
void swiglu_avx512(const float* g, const float* u, float* out, int64_t n) { run(g, u, out, n); }
#elif QMM_ISA == 2
void swiglu_avx2(const float* g, const float* u, float* out, int64_t n) { run(g, u, out, n); }
#else
void swiglu_generic(const float* g, const float* u, float* out, int64_t n) { run(g, u, out, n); }
#endif

}  // namespace mlxkv

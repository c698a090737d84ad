// 16 float lanes: one AVX-512 register, two AVX2 registers, or a portable array; the same
// operations in each, so every instruction set computes the same bits (see qmm.h). Include it
// inside an anonymous namespace of a per-ISA translation unit (QMM_ISA = 0, 2 or 3).
#pragma once

#if QMM_ISA == 3
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V16 set1(float x) { return {_mm512_set1_ps(x)}; }
  void fma(const V16& a, const V16& b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static V16 add(const V16& a, const V16& b) { return {_mm512_add_ps(a.v, b.v)}; }
  static V16 mul(const V16& a, const V16& b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static V16 div(const V16& a, const V16& b) { return {_mm512_div_ps(a.v, b.v)}; }
  static V16 sub(const V16& a, const V16& b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static V16 max(const V16& a, const V16& b) { return {_mm512_max_ps(a.v, b.v)}; }
  static V16 min(const V16& a, const V16& b) { return {_mm512_min_ps(a.v, b.v)}; }
  static V16 fmadd(const V16& a, const V16& b, const V16& c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
};
#elif QMM_ISA == 2
struct V16 {
  __m256 lo, hi;
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  void fma(const V16& a, const V16& b) {
    lo = _mm256_fmadd_ps(a.lo, b.lo, lo);
    hi = _mm256_fmadd_ps(a.hi, b.hi, hi);
  }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
  static V16 add(const V16& a, const V16& b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static V16 mul(const V16& a, const V16& b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static V16 div(const V16& a, const V16& b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  static V16 sub(const V16& a, const V16& b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static V16 max(const V16& a, const V16& b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  static V16 min(const V16& a, const V16& b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
  static V16 fmadd(const V16& a, const V16& b, const V16& c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
};
#else
struct V16 {
  float v[16];
  static V16 zero() { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = 0.0f; return r; }
  static V16 load(const float* p) { V16 r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static V16 set1(float x) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
  void fma(const V16& a, const V16& b) { for (int i = 0; i < 16; ++i) v[i] = std::fmaf(a.v[i], b.v[i], v[i]); }
  void store(float* p) const { std::memcpy(p, v, sizeof v); }
  static V16 add(const V16& a, const V16& b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
  static V16 mul(const V16& a, const V16& b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
  static V16 div(const V16& a, const V16& b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] / b.v[i]; return r; }
  static V16 sub(const V16& a, const V16& b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] - b.v[i]; return r; }
  // max_ps / min_ps: the second operand unless the first is strictly greater / less (NaN included).
  static V16 max(const V16& a, const V16& b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
  static V16 min(const V16& a, const V16& b) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i]; return r; }
  static V16 fmadd(const V16& a, const V16& b, const V16& c) {
    V16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = std::fmaf(a.v[i], b.v[i], c.v[i]);
    return r;
  }
};
#endif

// Keeps a loaded value in a register on AVX-512: without it GCC folds the load into every fma
// that uses it, loading it again for each (a loop that reuses one load across several
// accumulators). AVX2's 16 registers are better left to the compiler.
inline void pin([[maybe_unused]] V16& x) {
#if QMM_ISA == 3
  __asm__("" : "+v"(x.v));
#endif
}

// The fixed reduction tree shared by all instruction sets: l[i] + l[i + 8], then + 4, + 2, + 1.
// The SIMD paths add the same pairs in registers (halves of the vector), the portable one in scalars.
inline float reduce16(const V16& acc) {
#if QMM_ISA >= 2
#if QMM_ISA == 3
  const __m256 lo = _mm512_castps512_ps256(acc.v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc.v), 1));
#else
  const __m256 lo = acc.lo, hi = acc.hi;
#endif
  const __m256 h8 = _mm256_add_ps(lo, hi);
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#else
  float l[16];
  acc.store(l);
  for (int i = 0; i < 8; ++i) l[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) l[i] = l[i] + l[i + 4];
  for (int i = 0; i < 2; ++i) l[i] = l[i] + l[i + 2];
  return l[0] + l[1];
#endif
}

#if QMM_ISA == 3
// reduce16 of four accumulators at once: the same pairs added in the same operand order
// (l[i] + l[i + 8], then + 4, + 2, + 1), four sums per instruction. The sums of a0..a3 land in
// lanes 0, 4, 8 and 12.
inline __m512 reduce16x4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xee));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xee));
  const __m512 h4 = _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xdd));
  const __m512 h2 = _mm512_add_ps(h4, _mm512_shuffle_ps(h4, h4, 0x4e));
  return _mm512_add_ps(h2, _mm512_shuffle_ps(h2, h2, 0xb1));
}

// The four sums of reduce16x4, in order.
inline __m128 reduce16x4_sums(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(lanes, reduce16x4(a0, a1, a2, a3)));
}
#endif

// out[j] = reduce16(a_j) * scale for j = 0..3: the same bits as four reduce16 calls.
inline void reduce16x4_scaled(const V16& a0, const V16& a1, const V16& a2, const V16& a3, float scale, float* out) {
#if QMM_ISA == 3
  _mm_storeu_ps(out, _mm_mul_ps(reduce16x4_sums(a0.v, a1.v, a2.v, a3.v), _mm_set1_ps(scale)));
#else
  out[0] = reduce16(a0) * scale;
  out[1] = reduce16(a1) * scale;
  out[2] = reduce16(a2) * scale;
  out[3] = reduce16(a3) * scale;
#endif
}

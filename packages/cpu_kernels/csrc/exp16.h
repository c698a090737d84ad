// A 16-lane expf shared by the per-ISA kernels (softmax in attention_isa.cpp, the SiLU of
// activations_isa.cpp), written on lanes.h' V16. Include it after lanes.h, inside the anonymous
// namespace of a per-ISA translation unit (QMM_ISA = 0, 2 or 3; <immintrin.h>, <cstring> and
// <cmath> included).
#pragma once

constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpFloor = -87.0f;  // 2^n stays a normal float
constexpr float kExpCeiling = 88.0f;  // 2^n * y stays finite
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

// 2^n per lane for t = n + kMagic (n an integer in t's low mantissa bits): n's bits plus the
// exponent bias, shifted into the exponent field.
inline V16 pow2_of(const V16& t) {
#if QMM_ISA == 3
  const __m512i n = _mm512_sub_epi32(_mm512_castps_si512(t.v), _mm512_castps_si512(_mm512_set1_ps(kMagic)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23))};
#elif QMM_ISA == 2
  const __m256i magic = _mm256_castps_si256(_mm256_set1_ps(kMagic)), bias = _mm256_set1_epi32(127);
  const __m256i lo = _mm256_sub_epi32(_mm256_castps_si256(t.lo), magic);
  const __m256i hi = _mm256_sub_epi32(_mm256_castps_si256(t.hi), magic);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(lo, bias), 23)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(hi, bias), 23))};
#else
  V16 r;
  const float magic = kMagic;
  int32_t mb;
  std::memcpy(&mb, &magic, 4);
  for (int i = 0; i < 16; ++i) {
    int32_t tb;
    std::memcpy(&tb, &t.v[i], 4);
    const int32_t sb = int32_t(uint32_t(tb - mb + 127) << 23);
    std::memcpy(&r.v[i], &sb, 4);
  }
  return r;
#endif
}

// out[i] = exp(x), x = in[i] - shift clamped to [kExpFloor, kExpCeiling] (softmax passes in[i] <=
// shift, so only the floor acts there): Cephes' expf, one rounding per operation (fma where it says
// fma), the same operations on every instruction set (lanes.h), so the same bits.
inline void exp16(const float* in, float shift, float* out) {
  const V16 x = V16::min(V16::max(V16::sub(V16::load(in), V16::set1(shift)), V16::set1(kExpFloor)),
                         V16::set1(kExpCeiling));
  const V16 t = V16::fmadd(x, V16::set1(kLog2e), V16::set1(kMagic));
  const V16 n = V16::sub(t, V16::set1(kMagic));
  V16 r = V16::fmadd(n, V16::set1(-kLn2Hi), x);
  r = V16::fmadd(n, V16::set1(-kLn2Lo), r);
  V16 p = V16::set1(kP0);
  p = V16::fmadd(p, r, V16::set1(kP1));
  p = V16::fmadd(p, r, V16::set1(kP2));
  p = V16::fmadd(p, r, V16::set1(kP3));
  p = V16::fmadd(p, r, V16::set1(kP4));
  p = V16::fmadd(p, r, V16::set1(kP5));
  const V16 y = V16::add(V16::fmadd(p, V16::mul(r, r), r), V16::set1(1.0f));
  V16::mul(y, pow2_of(t)).store(out);
}

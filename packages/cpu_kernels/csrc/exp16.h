// A 16-lane expf shared by the per-ISA kernels (softmax in attention_isa.cpp, the SiLU of
// activations_isa.cpp). Include it inside the anonymous namespace of a per-ISA translation unit, after
// lanes.h' includes (QMM_ISA = 0, 2 or 3; <immintrin.h>, <cstring> and <cmath> included).
#pragma once

constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpFloor = -87.0f;  // 2^n stays a normal float
constexpr float kExpCeiling = 88.0f;  // 2^n * y stays finite
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

// out[i] = exp(x), x = in[i] - shift clamped to [kExpFloor, kExpCeiling] (softmax passes in[i] <=
// shift, so only the floor acts there): Cephes' expf, one rounding per operation (fma where it says
// fma), so every instruction set gives the same bits.
inline void exp16(const float* in, float shift, float* out) {
#if QMM_ISA == 3
  __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(in), _mm512_set1_ps(shift)), _mm512_set1_ps(kExpFloor));
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpCeiling));
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(kMagic));
  const __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(kMagic));
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(_mm512_set1_ps(kMagic)));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(127)), 23));
  _mm512_storeu_ps(out, _mm512_mul_ps(y, scale));
#elif QMM_ISA == 2
  for (int h = 0; h < 16; h += 8) {
    __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(in + h), _mm256_set1_ps(shift)), _mm256_set1_ps(kExpFloor));
    x = _mm256_min_ps(x, _mm256_set1_ps(kExpCeiling));
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(kMagic));
    const __m256 n = _mm256_sub_ps(t, _mm256_set1_ps(kMagic));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
    __m256 p = _mm256_set1_ps(kP0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
    __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(_mm256_set1_ps(kMagic)));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(127)), 23));
    _mm256_storeu_ps(out + h, _mm256_mul_ps(y, scale));
  }
#else
  for (int i = 0; i < 16; ++i) {
    float x = in[i] - shift;
    x = x > kExpFloor ? x : kExpFloor;  // max_ps(x, floor): x where x > floor, else floor
    x = x < kExpCeiling ? x : kExpCeiling;  // min_ps(x, ceiling)
    const float t = std::fmaf(x, kLog2e, kMagic);
    const float n = t - kMagic;
    float r = std::fmaf(n, -kLn2Hi, x);
    r = std::fmaf(n, -kLn2Lo, r);
    float p = kP0;
    p = std::fmaf(p, r, kP1);
    p = std::fmaf(p, r, kP2);
    p = std::fmaf(p, r, kP3);
    p = std::fmaf(p, r, kP4);
    p = std::fmaf(p, r, kP5);
    float y = std::fmaf(p, r * r, r);
    y = y + 1.0f;
    int32_t tb, mb;
    std::memcpy(&tb, &t, 4);
    const float magic = kMagic;
    std::memcpy(&mb, &magic, 4);
    const int32_t sb = int32_t(uint32_t(tb - mb + 127) << 23);
    float scale;
    std::memcpy(&scale, &sb, 4);
    out[i] = y * scale;
  }
#endif
}

// One instruction set's kernel; compiled three times (QMM_ISA = 0 generic, 2 AVX2, 3 AVX-512).
// NOTE: everything here is in an anonymous namespace and uses no std templates, so the three
// copies cannot be merged by the linker (an AVX-512 inline picked for the generic path would trap).
#include <cmath>
#include <cstring>

#include "qmm.h"

#if QMM_ISA >= 2
#include <immintrin.h>
#endif

namespace mlxkv {
namespace {

// The 16 per-lane partial sums of one output element (V16) and their fixed reduction tree.
#include "lanes.h"

// Rows of the dequantized-panel micro-kernel: what fits the instruction set's registers.
#if QMM_ISA == 3
constexpr int kRows = 4;
#elif QMM_ISA == 2
// half_micro's 3 x 4 accumulators, one register each: 12 fma chains in flight (8 leave the two FMA
// pipes waiting on latency; 4 x 4 spills). Standalone, 64 rows x 576 x 576 4-bit: 35 -> 74
// GFLOP/s on one core; 576 x 1536: 45 -> 40 (x outgrows L2 at 64 rows x 1536).
constexpr int kRows = 3;
#else
constexpr int kRows = 1;
#endif

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do { ++e; man <<= 1; } while ((man & 0x400) == 0);
    bits = sign | uint32_t(112 - e) << 23 | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float param(const QmmArgs& a, const void* p, int64_t i) {
  if (!a.scales_f16) return static_cast<const float*>(p)[i];
#if QMM_ISA >= 2
  return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);  // exact, like half_to_float
#else
  return half_to_float(static_cast<const uint16_t*>(p)[i]);
#endif
}

#if QMM_ISA >= 2
// param for a scale type P fixed at compile time (the tiles' with_layout): float or float16 bits.
template <typename P>
inline float typed_param(const P* p) {
  if constexpr (sizeof(P) == 4) {
    return *p;
  } else {
    return _cvtsh_ss(*p);
  }
}
#endif

#if QMM_ISA == 2
// One half of a block's codes (dequant32's lanes 0-7 or 8-15): the 8 bytes (4-bit) or 8 words
// (8-bit) at `src` zero-extended, then fma(q, s, b) of their low and high codes.
template <int kBits>
inline void dequant_half(const uint8_t* src, __m256 vs, __m256 vb, __m256& even, __m256& odd) {
  __m256i codes;
  if constexpr (kBits == 4) {
    codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  } else {
    codes = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  }
  const __m256i mask = _mm256_set1_epi32(kBits == 4 ? 0x0f : 0xff);
  even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(codes, mask)), vs, vb);
  odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(codes, kBits)), vs, vb);
}
#endif

// The 32 codes of block k0 (k0 % 32 == 0) starting at `src`, dequantized as fma(q, s, b) and split
// the way the packing lies: `even` holds k0 + 0, 2, ..., 30 and `odd` k0 + 1, 3, ..., 31 (x is
// permuted to match, see qmm.h). 4-bit byte i holds k0 + 2i (low nibble) and k0 + 2i + 1 (high);
// 8-bit word i holds the same two codes as bytes. So one zero-extension and a mask or a shift
// give both halves, with no byte shuffle.
inline void dequant32(const uint8_t* src, int bits, float s, float b, V16& even, V16& odd) {
#if QMM_ISA == 3
  __m512i codes, lo, hi;
  if (bits == 4) {
    codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    lo = _mm512_and_si512(codes, _mm512_set1_epi32(0x0f));
    hi = _mm512_srli_epi32(codes, 4);
  } else {
    codes = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    lo = _mm512_and_si512(codes, _mm512_set1_epi32(0xff));
    hi = _mm512_srli_epi32(codes, 8);
  }
  const __m512 vs = _mm512_set1_ps(s), vb = _mm512_set1_ps(b);
  even = {_mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), vs, vb)};
  odd = {_mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), vs, vb)};
#elif QMM_ISA == 2
  const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
  if (bits == 4) {
    dequant_half<4>(src, vs, vb, even.lo, odd.lo);
    dequant_half<4>(src + 8, vs, vb, even.hi, odd.hi);
  } else {
    dequant_half<8>(src, vs, vb, even.lo, odd.lo);
    dequant_half<8>(src + 16, vs, vb, even.hi, odd.hi);
  }
#else
  for (int i = 0; i < 16; ++i) {
    int lo, hi;
    if (bits == 4) {
      lo = src[i] & 0x0f, hi = src[i] >> 4;
    } else {
      lo = src[2 * i], hi = src[2 * i + 1];
    }
    even.v[i] = std::fmaf(float(lo), s, b);
    odd.v[i] = std::fmaf(float(hi), s, b);
  }
#endif
}

// Dequantizes output column n (all K) into dst, in the permuted order of qmm.h.
void dequant_column(const QmmArgs& a, int64_t n, float* dst) {
  const int64_t row_bytes = a.K * a.bits / 8, groups = a.K / a.group_size;
  const uint8_t* src = a.w + n * row_bytes;
  for (int64_t g = 0; g < groups; ++g) {
    float s = param(a, a.scales, n * groups + g), b = param(a, a.biases, n * groups + g);
    for (int64_t k = g * a.group_size; k < (g + 1) * a.group_size; k += 32) {
      V16 even, odd;
      dequant32(src + k * a.bits / 8, a.bits, s, b, even, odd);
      even.store(dst + k);
      odd.store(dst + k + 16);
    }
  }
}

#if QMM_ISA == 3
inline __m512 reg(__m512 v) { return v; }
inline __m512 reg(const V16& v) { return v.v; }
#endif

// The R x C tile's sums (V16 accumulators, or __m512 on AVX-512) into y (row stride ld): reduce16
// each; AVX-512 reduces four accumulators per reduce16x4 (the same bits), except for one row (the
// GEMV), where reduce16 per element measured no slower.
template <int R, int C, class A>
inline void store_sums(const A (&acc)[R][C], float* y, int64_t ld) {
#if QMM_ISA != 3
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ld + c] = reduce16(acc[r][c]);
#else
  // Unrolled whole, so that acc stays in registers (indexed in a loop, GCC puts it on the stack).
  if constexpr (R == 1) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) y[c] = reduce16(V16{reg(acc[0][c])});
    return;
  }
#pragma GCC unroll 8
  for (int i = 0; i < R * C; i += 4) {
    __m512 v[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) v[j] = i + j < R * C ? reg(acc[(i + j) / C][(i + j) % C]) : _mm512_setzero_ps();
    float sums[4];
    _mm_storeu_ps(sums, reduce16x4_sums(v[0], v[1], v[2], v[3]));
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      if (i + j < R * C) y[(i + j) / C * ld + (i + j) % C] = sums[j];
  }
#endif
}

#if QMM_ISA == 2
// The end of an AVX2 tile's walk over K for one half of the lanes (see half_tile): the first
// keeps its sums (lanes 0-7) in `low`, the second stores the elements' trees.
template <int R, int C>
inline void end_walk(int half, __m256 (&low)[R][C], const __m256 (&acc)[R][C], float* y, int64_t ld) {
  if (half == 0) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) low[r][c] = acc[r][c];
    return;
  }
  V16 sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = {low[r][c], acc[r][c]};
  store_sums<R, C>(sums, y, ld);
}

// micro on AVX2: as half_tile, K walked once per half of the 16 lanes (lanes 0-7 read k % 16 < 8,
// lanes 8-15 the rest), one register per accumulator; same chains, same bits.
template <int R, int C>
void half_micro(const QmmArgs& a, int64_t m, int64_t n, const float* panel, int64_t ld) {
  __m256 low[R][C];
  for (int half = 0; half < 2; ++half) {
    const float* x = a.x + m * a.K + 8 * half;
    const float* p = panel + 8 * half;
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < a.K; k += 16) {
      __m256 wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(p + c * ld + k);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * a.K + k);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
    end_walk<R, C>(half, low, acc, a.y + m * a.N + n, a.N);
  }
}
#endif

// R rows x C columns of output, all K, 16 lanes per element; column c of the panel starts at
// panel + c * ld. AVX-512 reduces the sums four at a time (store_sums; at 64 rows 1536 x 576 and
// 576 x 576 12-13% faster than reduce16 per element, 576 x 1536 1%).
template <int R, int C>
void micro(const QmmArgs& a, int64_t m, int64_t n, const float* panel, int64_t ld) {
#if QMM_ISA == 2
  half_micro<R, C>(a, m, n, panel, ld);
#else
  V16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V16::zero();
  const float* x = a.x + m * a.K;
  for (int64_t k = 0; k < a.K; k += 16) {
    V16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = V16::load(panel + c * ld + k);
    for (int r = 0; r < R; ++r) {
      V16 xv = V16::load(x + r * a.K + k);
      for (int c = 0; c < C; ++c) acc[r][c].fma(xv, wv[c]);
    }
  }
  store_sums<R, C>(acc, a.y + m * a.N + n, a.N);
#endif
}

template <int R>
void micro_cols(const QmmArgs& a, int64_t m, int64_t n, int cols, const float* panel, int64_t ld) {
  switch (cols) {
    case 4: micro<R, 4>(a, m, n, panel, ld); break;
    case 3: micro<R, 3>(a, m, n, panel, ld); break;
    case 2: micro<R, 2>(a, m, n, panel, ld); break;
    default: micro<R, 1>(a, m, n, panel, ld); break;
  }
}

// GEMV streams each weight once from memory: fetch the rows `ahead` columns on (the next call's)
// while this call computes, a few lines ahead. Prefetches never fault, past the end of w included.
inline void prefetch_next_rows(const uint8_t* next_rows, int64_t block, int bytes_per_block) {
  const uint8_t* p = next_rows + 256 + block * bytes_per_block;
  for (int off = 0; off < bytes_per_block; off += 64) __builtin_prefetch(p + off);
}

// R rows (R <= 8), C columns: each block's weights are dequantized in registers and serve all R
// rows at once. The arithmetic is exactly micro<R, C> on a dequantized panel (same fma(q, s, b),
// same chain), without the panel's store and reload, which is most of a GEMV's cost (R = 1); so a
// row gets the same bits alone or among a few. `ahead` > 0 prefetches the C columns that far on;
// 0 when the caller knows they are already cached.
template <int R, int C>
void gemv_rows(const QmmArgs& a, int64_t m, int64_t n, int64_t ahead) {
  const int64_t row_bytes = a.K * a.bits / 8, groups = a.K / a.group_size;
  const float* x = a.x + m * a.K;
  V16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V16::zero();
  for (int64_t g = 0; g < groups; ++g) {
    float s[C], b[C];
    for (int c = 0; c < C; ++c) {
      s[c] = param(a, a.scales, (n + c) * groups + g);
      b[c] = param(a, a.biases, (n + c) * groups + g);
    }
    for (int64_t k = g * a.group_size; k < (g + 1) * a.group_size; k += 32) {
      if (ahead > 0) prefetch_next_rows(a.w + (n + ahead) * row_bytes, k / 32, 4 * C * a.bits);
      V16 even[C], odd[C];
      for (int c = 0; c < C; ++c) dequant32(a.w + (n + c) * row_bytes + k * a.bits / 8, a.bits, s[c], b[c], even[c], odd[c]);
      for (int r = 0; r < R; ++r) {
        V16 x_even = V16::load(x + r * a.K + k), x_odd = V16::load(x + r * a.K + k + 16);
        for (int c = 0; c < C; ++c) {
          acc[r][c].fma(x_even, even[c]);
          acc[r][c].fma(x_odd, odd[c]);
        }
      }
    }
  }
  store_sums<R, C>(acc, a.y + m * a.N + n, a.N);
}

#if QMM_ISA == 3
// gemv_rows for 8-bit codes on AVX-512, with the scale type fixed at compile time and x kept in
// registers across the C columns (so up to 8 rows x 2 columns fit the 32 registers without
// reloading x per column). Same dequantization, same fma chain, same bits as gemv_rows.
template <int R, int C, typename P, int kBlocks>
void rows8_tile(const QmmArgs& a, int64_t m, int64_t n, int64_t ahead) {
  const int64_t row_bytes = a.K, groups = a.K / a.group_size;
  const int64_t blocks_per_group = kBlocks > 0 ? kBlocks : a.group_size / 32;
  const float* x = a.x + m * a.K;
  const uint8_t* w = a.w + n * row_bytes;
  const uint8_t* next = w + ahead * row_bytes + 256;  // the rows `ahead` columns on, 4 lines ahead
  const P* scales = static_cast<const P*>(a.scales) + n * groups;
  const P* biases = static_cast<const P*>(a.biases) + n * groups;
  const __m512i low_byte = _mm512_set1_epi32(0xff);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 vs[C], vb[C];
    for (int c = 0; c < C; ++c) {
      vs[c] = _mm512_set1_ps(typed_param(scales + c * groups + g));
      vb[c] = _mm512_set1_ps(typed_param(biases + c * groups + g));
    }
    for (int64_t j = 0; j < blocks_per_group; ++j, k += 32, w += 32) {
      if (ahead > 0) {
        for (int off = 0; off < 32 * C; off += 64) __builtin_prefetch(next + off);
        next += 32 * C;
      }
      __m512 even[C], odd[C];
      for (int c = 0; c < C; ++c) {
        const __m512i codes =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * row_bytes)));
        even[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(codes, low_byte)), vs[c], vb[c]);
        odd[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 8)), vs[c], vb[c]);
      }
      for (int r = 0; r < R; ++r) {
        __m512 x_even = _mm512_loadu_ps(x + r * a.K + k), x_odd = _mm512_loadu_ps(x + r * a.K + k + 16);
        // One load per row, not one per column: GCC would fold the load into each fma.
        __asm__("" : "+v"(x_even), "+v"(x_odd));
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm512_fmadd_ps(x_even, even[c], acc[r][c]);
          acc[r][c] = _mm512_fmadd_ps(x_odd, odd[c], acc[r][c]);
        }
      }
    }
  }
  store_sums<R, C>(acc, a.y + m * a.N + n, a.N);
}

// rows8_tile for 4-bit codes: vpermps reads only the low 4 bits of each index, so the group's 16
// possible weights fma(q, s, b), q = 0..15, computed once per group and column, are looked up
// instead of masked, converted and fma'd per code. Same floats, same chain, same bits.
template <typename P>
inline __m512 group_table(const P* scales, const P* biases, int64_t g) {
  const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(q, _mm512_set1_ps(typed_param(scales + g)), _mm512_set1_ps(typed_param(biases + g)));
}

// R rows (R <= 8) x C columns with the table: each block's looked-up weights serve all R rows,
// x stays in registers across the C columns. Every element is gemv_rows' chain (same weights,
// same fma order), so a row gets the same bits alone, among a speculative round's positions or
// in a batch. `ahead` as in gemv_rows.
template <int R, int C, typename P, int kBlocks>
void rows4_table(const QmmArgs& a, int64_t m, int64_t n, int64_t ahead) {
  const int64_t row_bytes = a.K / 2, groups = a.K / a.group_size;
  const int64_t blocks_per_group = kBlocks > 0 ? kBlocks : a.group_size / 32;
  const float* x = a.x + m * a.K;
  const uint8_t* w = a.w + n * row_bytes;
  const uint8_t* next = w + ahead * row_bytes + 256;  // the rows `ahead` columns on, 4 lines ahead
  const P* scales = static_cast<const P*>(a.scales) + n * groups;
  const P* biases = static_cast<const P*>(a.biases) + n * groups;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 table[C];
    for (int c = 0; c < C; ++c) table[c] = group_table(scales + c * groups, biases + c * groups, g);
    for (int64_t j = 0; j < blocks_per_group; ++j, k += 32, w += 16) {
      if (ahead > 0) {
        for (int off = 0; off < 16 * C; off += 64) __builtin_prefetch(next + off);
        next += 16 * C;
      }
      __m512 even[C], odd[C];
      for (int c = 0; c < C; ++c) {
        const __m512i codes =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * row_bytes)));
        even[c] = _mm512_permutexvar_ps(codes, table[c]);
        odd[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table[c]);
      }
      for (int r = 0; r < R; ++r) {
        __m512 x_even = _mm512_loadu_ps(x + r * a.K + k), x_odd = _mm512_loadu_ps(x + r * a.K + k + 16);
        if constexpr (R > 1) __asm__("" : "+v"(x_even), "+v"(x_odd));  // as in rows8_tile
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm512_fmadd_ps(x_even, even[c], acc[r][c]);
          acc[r][c] = _mm512_fmadd_ps(x_odd, odd[c], acc[r][c]);
        }
      }
    }
  }
  store_sums<R, C>(acc, a.y + m * a.N + n, a.N);
}

#endif

#if QMM_ISA >= 2
// kernel.operator()<P, B>() for this product: P the scales' type, B the blocks of 32 codes per
// group where groups are 32 wide (GGUF's), so the block loop's count is known at compile time
// (measured ~10% faster at 8 rows), else 0 (read from the arguments).
template <class Kernel>
inline void with_layout(const QmmArgs& a, Kernel&& kernel) {
  const bool narrow = a.group_size == 32;
  if (a.scales_f16) {
    narrow ? kernel.template operator()<uint16_t, 1>() : kernel.template operator()<uint16_t, 0>();
  } else {
    narrow ? kernel.template operator()<float, 1>() : kernel.template operator()<float, 0>();
  }
}
#endif

#if QMM_ISA == 2
// AVX2 holds an element's 16 lane sums in two registers, lanes 0-7 and 8-15: two chains that
// meet only in the final tree, and each reads its own half of every block of 32 codes (4-bit:
// bytes 0-7 and 8-15; 8-bit: words 0-7 and 8-15) and of x. So a tile walks K twice, once per
// half, with one register per accumulator: R x C accumulators fit 16 registers where gemv_rows'
// 2 R C spilled (8 x 2, and the GEMV's 1 x 4 with its weights). Same fma(q, s, b), same chains,
// same tree: gemv_rows' bits.
template <int R, int C, typename P, int kBlocks, int kBits>
void half_tile(const QmmArgs& a, int64_t m, int64_t n, int64_t ahead) {
  constexpr int kBlockBytes = 4 * kBits, kHalfBytes = 2 * kBits;
  const int64_t row_bytes = a.K * kBits / 8, groups = a.K / a.group_size;
  const int64_t blocks_per_group = kBlocks > 0 ? kBlocks : a.group_size / 32;
  const P* scales = static_cast<const P*>(a.scales) + n * groups;
  const P* biases = static_cast<const P*>(a.biases) + n * groups;
  __m256 low[R][C];  // lanes 0-7 of every element, from the first walk
  for (int half = 0; half < 2; ++half) {
    const float* x = a.x + m * a.K + 8 * half;
    const uint8_t* w = a.w + n * row_bytes + half * kHalfBytes;
    const uint8_t* next = a.w + (n + ahead) * row_bytes + 256;  // the rows `ahead` columns on
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t j = 0; j < blocks_per_group; ++j, k += 32, w += kBlockBytes) {
        if (half == 0 && ahead > 0) {
          for (int off = 0; off < kBlockBytes * C; off += 64) __builtin_prefetch(next + off);
          next += kBlockBytes * C;
        }
        for (int c = 0; c < C; ++c) {
          // Each column's scale and bias where they are used, not all C held across the block:
          // with 12 accumulators the registers have no room for 2 C more.
          const __m256 vs = _mm256_set1_ps(typed_param(scales + c * groups + g));
          const __m256 vb = _mm256_set1_ps(typed_param(biases + c * groups + g));
          __m256 even, odd;
          dequant_half<kBits>(w + c * row_bytes, vs, vb, even, odd);
          for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * a.K + k), even, acc[r][c]);
          for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * a.K + k + 16), odd, acc[r][c]);
        }
      }
    }
    end_walk<R, C>(half, low, acc, a.y + m * a.N + n, a.N);
  }
}
#endif

// One R x C tile of few_rows or the GEMV: the AVX-512 kernels where there is one, else gemv_rows.
template <int R, int C>
void row_tile(const QmmArgs& a, int64_t m, int64_t n, int64_t ahead) {
#if QMM_ISA == 3
  if (a.bits == 4) {
    with_layout(a, [&]<typename P, int B>() { rows4_table<R, C, P, B>(a, m, n, ahead); });
    return;
  }
  if (a.bits == 8) {
    with_layout(a, [&]<typename P, int B>() { rows8_tile<R, C, P, B>(a, m, n, ahead); });
    return;
  }
#elif QMM_ISA == 2
  if (a.bits == 4) {
    with_layout(a, [&]<typename P, int B>() { half_tile<R, C, P, B, 4>(a, m, n, ahead); });
    return;
  }
  if (a.bits == 8) {
    with_layout(a, [&]<typename P, int B>() { half_tile<R, C, P, B, 8>(a, m, n, ahead); });
    return;
  }
#endif
  gemv_rows<R, C>(a, m, n, ahead);
}

// Up to kFewRows rows in one pass over the weights: for each tile of kTileCols columns, every row
// sub-tile (at most sub_rows rows) in turn, while the tile's codes and the sub-tile's x are still
// in L1; the first sub-tile prefetches the next tile. Sub-tiles of 5..8 rows take 2 columns at a
// time (4-bit on AVX-512: 3 at 5 or 6 rows), up to 4 rows take 4 (R x C accumulators in
// registers); each block's dequantization serves R rows either way.
constexpr int64_t kTileCols = 16, kSubRows = 8;
// Past it the dequantized panel: on AVX-512 past 16 rows; on AVX2 too (at 9-16 rows its half_tile
// sub-tiles and half_micro's panel measured alike, both well ahead of the old spilling panel);
// the portable path past one sub-tile.
constexpr int64_t kFewRows = QMM_ISA >= 2 ? 16 : kSubRows;

// Columns [n, n + cols) of one sub-tile, C at a time, then a pair, then singles.
template <int R, int C>
void sub_tile_cols(const QmmArgs& a, int64_t m, int64_t n, int64_t cols, bool first) {
  int64_t c = 0;
  for (; c + C <= cols; c += C) row_tile<R, C>(a, m, n + c, first ? kTileCols : 0);
  if (C > 2 && c + 2 <= cols) {
    row_tile<R, 2>(a, m, n + c, first ? kTileCols : 0);
    c += 2;
  }
  for (; c < cols; ++c) row_tile<R, 1>(a, m, n + c, first ? 1 : 0);
}

template <int R>
void sub_tile(const QmmArgs& a, int64_t m, int64_t n, int64_t cols, bool first) {
#if QMM_ISA == 3
  // The 4-bit tile keeps one table per column instead of a scale and a bias: 5 or 6 rows x 3
  // columns fit the registers, and fewer columns per x load measured slower there.
  if (a.bits == 4 && (R == 5 || R == 6)) {
    sub_tile_cols<R, 3>(a, m, n, cols, first);
    return;
  }
#endif
#if QMM_ISA == 2
  // half_tile: one register per accumulator, so R x C <= 8 leaves room for the weights.
  sub_tile_cols<R, R <= 2 ? 4 : R <= 4 ? 2 : 1>(a, m, n, cols, first);
#else
  sub_tile_cols<R, R <= 4 ? 4 : 2>(a, m, n, cols, first);
#endif
}

void sub_tile_rows(const QmmArgs& a, int64_t m, int64_t rows, int64_t n, int64_t cols, bool first) {
  switch (rows) {
#if QMM_ISA == 2
    case 10: sub_tile<10>(a, m, n, cols, first); break;
    case 9: sub_tile<9>(a, m, n, cols, first); break;
#endif
    case 8: sub_tile<8>(a, m, n, cols, first); break;
    case 7: sub_tile<7>(a, m, n, cols, first); break;
    case 6: sub_tile<6>(a, m, n, cols, first); break;
    case 5: sub_tile<5>(a, m, n, cols, first); break;
    case 4: sub_tile<4>(a, m, n, cols, first); break;
    case 3: sub_tile<3>(a, m, n, cols, first); break;
    case 2: sub_tile<2>(a, m, n, cols, first); break;
    default: sub_tile<1>(a, m, n, cols, first); break;
  }
}

// Rows of a sub-tile: kSubRows, except on AVX2. There, over a long K, 8 rows of x (48 KB at K =
// 1536) outgrow L1 and every column pass would read x again from L2: 4 rows (standalone, an
// 8-row 576 x 1536 product ~1.9x faster as two 4-row sub-tiles; at K = 576 one 8-row sub-tile
// stays faster). Over a short K up to 10 rows, one register per accumulator still (C = 1): a
// speculative round of 8 drafts feeds 9 rows, which as sub-tiles of 5 and 4 dequantized every
// block twice (`tools.bench_kernel --step-rows 8 9 10 --head-bits 8`, 2 threads, the previous
// build and this one alternating: 9 rows 25.4 -> 23.2-23.7 ms, 1.28-1.30x -> 1.17-1.19x 8 rows;
// 10 rows 28.8-29.0 -> 26.0-26.4; 11 and 12 rows in one sub-tile measured no faster than two).
inline int64_t sub_rows([[maybe_unused]] const QmmArgs& a) {
#if QMM_ISA == 2
  constexpr int64_t kAvx2ShortKRows = 10;
  return a.K > 1024 ? 4 : kAvx2ShortKRows;
#else
  return kSubRows;
#endif
}

// Rows [m0, m1), at most kFewRows of them, split into near-equal sub-tiles of at most sub_rows.
void few_rows(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  const int64_t rows = m1 - m0, most = sub_rows(a), parts = (rows + most - 1) / most;
  for (int64_t n = n0; n < n1; n += kTileCols) {
    const int64_t cols = n1 - n < kTileCols ? n1 - n : kTileCols;
    for (int64_t p = 0, m = m0; p < parts; ++p) {
      const int64_t sub = rows / parts + (p < rows % parts ? 1 : 0);
      sub_tile_rows(a, m, sub, n, cols, p == 0);
      m += sub;
    }
  }
}

// One row: 4 columns at a time, each tile prefetching the next one's.
void run_gemv(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) row_tile<1, 4>(a, m, n, 4);
  for (; n < n1; ++n) row_tile<1, 1>(a, m, n, 1);
}

#if QMM_ISA == 2
// R rows (2..5) over a short K on AVX2: few_rows' sub-tile (same C, same bits), one R x C tile
// after another along the columns, each prefetching the next C columns as the GEMV does, where
// few_rows' 16-column tiles prefetch a whole tile ahead (`tools.bench_kernel --step-rows 2 3 4 5
// --head-bits 8`, 2 threads, alternating: 2-5 rows' products 3-5% faster; the rows a speculative
// round of 1-4 drafts feeds).
template <int R>
void run_stream(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m) {
  constexpr int C = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  int64_t n = n0;
  for (; n + C <= n1; n += C) row_tile<R, C>(a, m, n, C);
  for (; n < n1; ++n) row_tile<R, 1>(a, m, n, 1);
}
#endif

void run_range(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1, float* panel) {
  if (m1 - m0 == 1) {
    run_gemv(a, n0, n1, m0);
    return;
  }
#if QMM_ISA == 2
  if (a.K <= 1024) {
    switch (m1 - m0) {
      case 2: run_stream<2>(a, n0, n1, m0); return;
      case 3: run_stream<3>(a, n0, n1, m0); return;
      case 4: run_stream<4>(a, n0, n1, m0); return;
      case 5: run_stream<5>(a, n0, n1, m0); return;
      default: break;
    }
  }
#endif
  if (m1 - m0 <= kFewRows) {
    few_rows(a, n0, n1, m0, m1);
    return;
  }
  for (int64_t n = n0; n < n1; n += kPanelCols) {
    int cols = int(n1 - n < kPanelCols ? n1 - n : kPanelCols);
    for (int c = 0; c < cols; ++c) dequant_column(a, n + c, panel + c * a.K);
    int64_t m = m0;
    for (; m + kRows <= m1; m += kRows) micro_cols<kRows>(a, m, n, cols, panel, a.K);
    for (; m < m1; ++m) micro_cols<1>(a, m, n, cols, panel, a.K);
  }
}

// Dense: b_rows holds the N rows of op(B)^T, a.K floats each, ldb apart; same micro-kernel, no
// dequantization.
void run_dense(const QmmArgs& a, const float* b_rows, int64_t ldb) {
  for (int64_t n = 0; n < a.N; n += kPanelCols) {
    int cols = int(a.N - n < kPanelCols ? a.N - n : kPanelCols);
    int64_t m = 0;
    for (; m + kRows <= a.M; m += kRows) micro_cols<kRows>(a, m, n, cols, b_rows + n * ldb, ldb);
    for (; m < a.M; ++m) micro_cols<1>(a, m, n, cols, b_rows + n * ldb, ldb);
  }
}

// One row of A times a row-major (K, N) B, read as it lies: lane l of output j accumulates the k
// with k % 16 == l in ascending order, then the same tree. Bit for bit what run_dense gives on
// packed operands, with no transpose of B (attention's p.v in decode).
void run_row(const float* a_row, int64_t k, const float* b, int64_t ldb, int64_t n, float* out, float* lanes) {
  for (int64_t i = 0; i < 16 * n; ++i) lanes[i] = 0.0f;
  for (int64_t kk = 0; kk < k; ++kk) {
    float* acc = lanes + (kk % 16) * n;
    const float av = a_row[kk];
    const float* brow = b + kk * ldb;
    for (int64_t j = 0; j < n; ++j) acc[j] = std::fmaf(av, brow[j], acc[j]);
  }
  for (int64_t j = 0; j < n; ++j) {
    float l[16];
    for (int i = 0; i < 16; ++i) l[i] = lanes[i * n + j];
    for (int i = 0; i < 8; ++i) l[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; ++i) l[i] = l[i] + l[i + 4];
    for (int i = 0; i < 2; ++i) l[i] = l[i] + l[i + 2];
    out[j] = l[0] + l[1];
  }
}

}  // namespace

#if QMM_ISA == 3
void qmm_range_avx512(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1, float* panel) {
  run_range(a, n0, n1, m0, m1, panel);
}
void dense_avx512(const QmmArgs& a, const float* b_rows, int64_t ldb) { run_dense(a, b_rows, ldb); }
void row_avx512(const float* a_row, int64_t k, const float* b, int64_t ldb, int64_t n, float* out, float* lanes) {
  run_row(a_row, k, b, ldb, n, out, lanes);
}
#elif QMM_ISA == 2
void qmm_range_avx2(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1, float* panel) {
  run_range(a, n0, n1, m0, m1, panel);
}
void dense_avx2(const QmmArgs& a, const float* b_rows, int64_t ldb) { run_dense(a, b_rows, ldb); }
void row_avx2(const float* a_row, int64_t k, const float* b, int64_t ldb, int64_t n, float* out, float* lanes) {
  run_row(a_row, k, b, ldb, n, out, lanes);
}
#else
void qmm_range_generic(const QmmArgs& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1, float* panel) {
  run_range(a, n0, n1, m0, m1, panel);
}
void dense_generic(const QmmArgs& a, const float* b_rows, int64_t ldb) { run_dense(a, b_rows, ldb); }
void row_generic(const float* a_row, int64_t k, const float* b, int64_t ldb, int64_t n, float* out, float* lanes) {
  run_row(a_row, k, b, ldb, n, out, lanes);
}
#endif

}  // namespace mlxkv

// One instruction set's attention kernel (see attention.h); compiled three times like qmm_isa.cpp,
// with the same rule: an anonymous namespace and no std templates.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"

#if QMM_ISA >= 2
#include <immintrin.h>
#endif

namespace mlxkv {
namespace {

#include "lanes.h"

#include "exp16.h"

// The largest of w[0..n): exact in any order.
inline float max_of(const float* w, int64_t n) {
  int64_t t = 0;
  float top = w[0];
#if QMM_ISA == 3
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(w);
    for (t = 16; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(w + t));
    top = _mm512_reduce_max_ps(m);
  }
#endif
  for (; t < n; ++t) top = w[t] > top ? w[t] : top;
  return top;
}

// w[0..n) = exp(score - max) in place, w[n..padded) = 0; returns 1 / sum(w) summed as attention.h says.
inline float softmax_in_place(float* w, int64_t n) {
  const float top = max_of(w, n);
  const int64_t padded = (n + 15) / 16 * 16;
  for (int64_t t = n; t < padded; ++t) w[t] = top;
  V16 sum = V16::zero();
  const V16 one = V16::set1(1.0f);
  for (int64_t t = 0; t < padded; t += 16) {
    exp16(w + t, top, w + t);
    if (t + 16 > n) {
      for (int64_t i = n; i < padded; ++i) w[i] = 0.0f;
    }
    sum.fma(V16::load(w + t), one);  // w * 1 + sum: exactly an add
  }
  return 1.0f / reduce16(sum);
}

// The most query heads per kv head (primitive.cpp checks it).
constexpr int64_t kMaxGroup = 64;

// out[h] = (fma-chain over t of w_h[t] * values[t]) * inv[h] for H heads (scores `stride` apart).
template <int C, int H>
inline void weigh_values(const float* values, int64_t n, const float* w, int64_t stride, const float* inv,
                         float* out) {
  constexpr int64_t D = 16 * C;
  V16 acc[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = V16::zero();
  for (int64_t t = 0; t < n; ++t) {
    V16 v[C];
    for (int c = 0; c < C; ++c) {
      v[c] = V16::load(values + t * D + 16 * c);
      if constexpr (H > 1) pin(v[c]);
    }
    for (int h = 0; h < H; ++h) {
      const V16 wt = V16::set1(w[h * stride + t]);
      for (int c = 0; c < C; ++c) acc[h][c].fma(wt, v[c]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const V16 vinv = V16::set1(inv[h]);
    for (int c = 0; c < C; ++c) {
      V16 o = V16::zero();
      o.fma(acc[h][c], vinv);  // acc * inv + 0: exactly a product
      o.store(out + h * D + 16 * c);
    }
  }
}

// w_h[t] = reduce16(fma-chain over c of q_h[16c..] * k_t[16c..]) * scale for H heads of a group
// (queries D apart, scores `stride` apart) against keys 0..n-1: each key is loaded once for the
// H heads, and four keys' sums reduce together, each element's chain and tree as attention.h says.
template <int C, int H>
inline void score_keys(const float* keys, int64_t n, const float* q, float scale, float* w, int64_t stride) {
  constexpr int64_t D = 16 * C;
  V16 qv[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) qv[h][c] = V16::load(q + h * D + 16 * c);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {  // four keys' chains side by side (each its own order)
    V16 acc[H][4];
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = V16::zero();
    const float* k = keys + t * D;
    for (int c = 0; c < C; ++c) {
      V16 k0 = V16::load(k + 16 * c), k1 = V16::load(k + D + 16 * c), k2 = V16::load(k + 2 * D + 16 * c),
          k3 = V16::load(k + 3 * D + 16 * c);
      if constexpr (H > 1) {
        pin(k0);
        pin(k1);
        pin(k2);
        pin(k3);
      }
      for (int h = 0; h < H; ++h) {
        acc[h][0].fma(qv[h][c], k0);
        acc[h][1].fma(qv[h][c], k1);
        acc[h][2].fma(qv[h][c], k2);
        acc[h][3].fma(qv[h][c], k3);
      }
    }
    for (int h = 0; h < H; ++h) reduce16x4_scaled(acc[h][0], acc[h][1], acc[h][2], acc[h][3], scale, w + h * stride + t);
  }
  for (; t < n; ++t) {
    for (int h = 0; h < H; ++h) {
      V16 d = V16::zero();
      for (int c = 0; c < C; ++c) d.fma(qv[h][c], V16::load(keys + t * D + 16 * c));
      w[h * stride + t] = reduce16(d) * scale;
    }
  }
}

// C = D / 16 chunks of the head, known at compile time so the accumulators stay in registers.
template <int C>
void attend_chunks(const AttnArgs& a, const AttnSequence& s, int64_t r, int64_t g, float* scratch) {
  constexpr int64_t D = 16 * C;
  constexpr int64_t kHeadBlock = C <= 4 ? 4 : C <= 8 ? 2 : 1;
  // Heads scored per pass over the keys: their queries and four keys' accumulators in AVX-512's
  // 32 registers (AVX2's 16 hold one head's).
  constexpr int64_t kScoreBlock = QMM_ISA == 3 ? (C <= 2 ? 4 : C <= 4 ? 3 : 1) : 1;
  const int64_t group = a.heads / a.kv_heads;
  const int64_t n = s.position + (r - s.first_row) + 1;
  const int64_t stride = (n + 15) / 16 * 16;
  const float* keys = s.keys + g * s.capacity * D;
  const float* values = s.values + g * s.capacity * D;
  const float* q = a.q + (r * a.heads + g * group) * D;
  for (int64_t i = 0; i < group;) {
    const int64_t take = group - i < kScoreBlock ? group - i : kScoreBlock;
    float* w = scratch + i * stride;
    switch (take) {
      case 4: score_keys<C, (kScoreBlock >= 4 ? 4 : 1)>(keys, n, q + i * D, a.scale, w, stride); break;
      case 3: score_keys<C, (kScoreBlock >= 3 ? 3 : 1)>(keys, n, q + i * D, a.scale, w, stride); break;
      case 2: score_keys<C, (kScoreBlock >= 2 ? 2 : 1)>(keys, n, q + i * D, a.scale, w, stride); break;
      default: score_keys<C, 1>(keys, n, q + i * D, a.scale, w, stride); break;
    }
    i += take;
  }
  float inv[kMaxGroup];
  for (int64_t i = 0; i < group; ++i) inv[i] = softmax_in_place(scratch + i * stride, n);
  // Each value row is loaded once for a block of the group's heads (the loads, not the
  // arithmetic, bound this loop); every head keeps its own chain.
  float* out = a.out + (r * a.heads + g * group) * D;
  for (int64_t i = 0; i < group;) {
    const int64_t take = group - i < kHeadBlock ? group - i : kHeadBlock;
    const float* w = scratch + i * stride;
    switch (take) {
      case 4: weigh_values<C, (kHeadBlock >= 4 ? 4 : 1)>(values, n, w, stride, inv + i, out + i * D); break;
      case 3: weigh_values<C, (kHeadBlock >= 3 ? 3 : 1)>(values, n, w, stride, inv + i, out + i * D); break;
      case 2: weigh_values<C, (kHeadBlock >= 2 ? 2 : 1)>(values, n, w, stride, inv + i, out + i * D); break;
      default: weigh_values<C, 1>(values, n, w, stride, inv + i, out + i * D); break;
    }
    i += take;
  }
}

void attend(const AttnArgs& a, const AttnSequence& s, int64_t r, int64_t g, float* scratch) {
  switch (a.dim / 16) {
    case 1: attend_chunks<1>(a, s, r, g, scratch); break;
    case 2: attend_chunks<2>(a, s, r, g, scratch); break;
    case 3: attend_chunks<3>(a, s, r, g, scratch); break;
    case 4: attend_chunks<4>(a, s, r, g, scratch); break;
    case 5: attend_chunks<5>(a, s, r, g, scratch); break;
    case 6: attend_chunks<6>(a, s, r, g, scratch); break;
    case 7: attend_chunks<7>(a, s, r, g, scratch); break;
    case 8: attend_chunks<8>(a, s, r, g, scratch); break;
    case 9: attend_chunks<9>(a, s, r, g, scratch); break;
    case 10: attend_chunks<10>(a, s, r, g, scratch); break;
    case 11: attend_chunks<11>(a, s, r, g, scratch); break;
    case 12: attend_chunks<12>(a, s, r, g, scratch); break;
    case 13: attend_chunks<13>(a, s, r, g, scratch); break;
    case 14: attend_chunks<14>(a, s, r, g, scratch); break;
    case 15: attend_chunks<15>(a, s, r, g, scratch); break;
    default: attend_chunks<16>(a, s, r, g, scratch); break;
  }
}

}  // namespace

#if QMM_ISA == 3
void attend_avx512(const AttnArgs& a, const AttnSequence& s, int64_t r, int64_t g,
                   float* scratch) {
  attend(a, s, r, g, scratch);
}
#elif QMM_ISA == 2
void attend_avx2(const AttnArgs& a, const AttnSequence& s, int64_t r, int64_t g,
                 float* scratch) {
  attend(a, s, r, g, scratch);
}
#else
void attend_generic(const AttnArgs& a, const AttnSequence& s, int64_t r, int64_t g,
                    float* scratch) {
  attend(a, s, r, g, scratch);
}
#endif

}  // namespace mlxkv

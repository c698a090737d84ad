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
#elif QMM_ISA == 2
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(w);
    for (t = 8; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(w + t));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    top = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
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

// Query heads (of one or several rows, "pairs") attended together against one kv head. Keys and
// values go by in blocks small enough to stay in L1 while every pair uses them, so a long context
// leaves memory once per block of rows, not once per head and row. Within a block, kPairs pairs
// at a time keep their accumulators in registers (AVX2's 16 hold 6, two registers each), each
// key chunk loaded once for them; the value accumulators rest in the pairs' outputs between key
// blocks. Every element's chain is its own and in ascending key order, so a row's output is the
// same whichever rows share its block.
constexpr int kPairs = 6;
constexpr int kMaxPairs = kAttnRowBlock * kMaxGroup;

struct Pair {
  const float* q;  // the head's query (D floats)
  float* w;        // its scores (round_up(n, 16) floats)
  float* out;      // its output (D floats): the value accumulators until the last key block
  int64_t n;       // keys it attends: 0 .. n - 1
  float inv;       // 1 / sum of its weights
};

// w[t] = reduce16(fma-chain over c of q[16c..] * k_t[16c..]) * scale for t0 <= t < t1 (a pair's
// scores past its own n are overwritten by its softmax and never read).
template <int C>
inline void score_pairs(const float* keys, Pair* p, int np, int64_t t0, int64_t t1, float scale) {
  constexpr int64_t D = 16 * C;
  for (int64_t t = t0; t < t1; ++t) {
    V16 acc[kPairs];
    for (int j = 0; j < kPairs; ++j) acc[j] = V16::zero();
    for (int c = 0; c < C; ++c) {
      const V16 k = V16::load(keys + t * D + 16 * c);
      for (int j = 0; j < kPairs; ++j) {
        if (j < np) acc[j].fma(V16::load(p[j].q + 16 * c), k);
      }
    }
    for (int j = 0; j < kPairs; ++j) {
      if (j < np) p[j].w[t] = reduce16(acc[j]) * scale;
    }
  }
}

// Continues out[16 c0 .. 16 (c0 + B)) += fma-chain over t0 <= t < min(t1, n) of w[t] * v_t for
// each pair (zero before the first key block).
template <int C, int B, int P>
inline void weigh_pairs(const float* values, const Pair* p, int np, int64_t t0, int64_t t1, int c0) {
  constexpr int64_t D = 16 * C;
  int64_t common = t1, longest = t0;
  for (int j = 0; j < np; ++j) {
    const int64_t end = p[j].n < t1 ? p[j].n : t1;
    common = end < common ? end : common;
    longest = end > longest ? end : longest;
  }
  common = common < t0 ? t0 : common;  // a pair that ended before this block takes no step in it
  V16 acc[P][B];
  for (int j = 0; j < P; ++j)
    for (int c = 0; c < B; ++c) acc[j][c] = j < np && t0 > 0 ? V16::load(p[j].out + 16 * (c0 + c)) : V16::zero();
  auto step = [&](int64_t t, bool all) {
    V16 v[B];
    for (int c = 0; c < B; ++c) v[c] = V16::load(values + t * D + 16 * (c0 + c));
    for (int j = 0; j < P; ++j) {
      if (j < np && (all || t < p[j].n)) {
        const V16 wt = V16::set1(p[j].w[t]);
        for (int c = 0; c < B; ++c) acc[j][c].fma(wt, v[c]);
      }
    }
  };
  for (int64_t t = t0; t < common; ++t) step(t, true);
  for (int64_t t = common; t < longest; ++t) step(t, false);
  for (int j = 0; j < np; ++j)
    for (int c = 0; c < B; ++c) acc[j][c].store(p[j].out + 16 * (c0 + c));
}

template <int C>
void attend_pairs(const AttnArgs& a, const AttnSequence& s, int64_t r0, int64_t rows, int64_t g, float* scratch) {
  constexpr int64_t D = 16 * C;
  constexpr int64_t kKeyBlock = 64;  // 16 KB of keys or values
  const int64_t group = a.heads / a.kv_heads;
  const int64_t stride = (s.position + (r0 + rows - 1 - s.first_row) + 1 + 15) / 16 * 16;
  const float* keys = s.keys + g * s.capacity * D;
  const float* values = s.values + g * s.capacity * D;
  Pair pairs[kMaxPairs];
  int np = 0;
  int64_t longest = 0;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    const int64_t n = s.position + (r - s.first_row) + 1;
    longest = n;
    for (int64_t h = 0; h < group; ++h, ++np) {
      const int64_t head = r * a.heads + g * group + h;
      pairs[np] = {a.q + head * D, scratch + np * stride, a.out + head * D, n, 0.0f};
    }
  }
  for (int64_t t0 = 0; t0 < longest; t0 += kKeyBlock) {
    const int64_t t1 = longest - t0 < kKeyBlock ? longest : t0 + kKeyBlock;
    for (int j = 0; j < np; j += kPairs) score_pairs<C>(keys, pairs + j, np - j < kPairs ? np - j : kPairs, t0, t1, a.scale);
  }
  for (int j = 0; j < np; ++j) pairs[j].inv = softmax_in_place(pairs[j].w, pairs[j].n);
  for (int64_t t0 = 0; t0 < longest; t0 += kKeyBlock) {
    const int64_t t1 = longest - t0 < kKeyBlock ? longest : t0 + kKeyBlock;
    for (int j = 0; j < np; j += kPairs) {
      const int take = np - j < kPairs ? np - j : kPairs;
      // Half a block's pairs take two value chunks a pass (the same registers).
      if (take <= kPairs / 2 && C % 2 == 0) {
        for (int c0 = 0; c0 < C; c0 += 2) weigh_pairs<C, 2, kPairs / 2>(values, pairs + j, take, t0, t1, c0);
      } else {
        for (int c0 = 0; c0 < C; ++c0) weigh_pairs<C, 1, kPairs>(values, pairs + j, take, t0, t1, c0);
      }
    }
  }
  for (int j = 0; j < np; ++j) {
    const V16 vinv = V16::set1(pairs[j].inv);
    for (int c = 0; c < C; ++c) {
      V16 o = V16::zero();
      o.fma(V16::load(pairs[j].out + 16 * c), vinv);  // acc * inv + 0: exactly a product
      o.store(pairs[j].out + 16 * c);
    }
  }
}

// Heads of up to 64 dimensions attend in pairs on AVX2 and the portable path; AVX-512 and wider
// heads keep the row-at-a-time kernel (on AVX2, 128-dimension heads over short contexts in memory
// measured slower in pairs; AVX-512 is tuned for it and the pair kernel is unmeasured there).
template <int C>
void attend_block(const AttnArgs& a, const AttnSequence& s, int64_t r0, int64_t rows, int64_t g, float* scratch) {
  if constexpr (QMM_ISA == 3 || C > 4) {
    for (int64_t r = r0; r < r0 + rows; ++r) attend_chunks<C>(a, s, r, g, scratch);
  } else {
    attend_pairs<C>(a, s, r0, rows, g, scratch);
  }
}

void attend(const AttnArgs& a, const AttnSequence& s, int64_t r0, int64_t rows, int64_t g, float* scratch) {
  switch (a.dim / 16) {
    case 1: attend_block<1>(a, s, r0, rows, g, scratch); break;
    case 2: attend_block<2>(a, s, r0, rows, g, scratch); break;
    case 3: attend_block<3>(a, s, r0, rows, g, scratch); break;
    case 4: attend_block<4>(a, s, r0, rows, g, scratch); break;
    case 5: attend_block<5>(a, s, r0, rows, g, scratch); break;
    case 6: attend_block<6>(a, s, r0, rows, g, scratch); break;
    case 7: attend_block<7>(a, s, r0, rows, g, scratch); break;
    case 8: attend_block<8>(a, s, r0, rows, g, scratch); break;
    case 9: attend_block<9>(a, s, r0, rows, g, scratch); break;
    case 10: attend_block<10>(a, s, r0, rows, g, scratch); break;
    case 11: attend_block<11>(a, s, r0, rows, g, scratch); break;
    case 12: attend_block<12>(a, s, r0, rows, g, scratch); break;
    case 13: attend_block<13>(a, s, r0, rows, g, scratch); break;
    case 14: attend_block<14>(a, s, r0, rows, g, scratch); break;
    case 15: attend_block<15>(a, s, r0, rows, g, scratch); break;
    default: attend_block<16>(a, s, r0, rows, g, scratch); break;
  }
}

}  // namespace

#if QMM_ISA == 3
void attend_avx512(const AttnArgs& a, const AttnSequence& s, int64_t r0, int64_t rows, int64_t g,
                   float* scratch) {
  attend(a, s, r0, rows, g, scratch);
}
#elif QMM_ISA == 2
void attend_avx2(const AttnArgs& a, const AttnSequence& s, int64_t r0, int64_t rows, int64_t g,
                 float* scratch) {
  attend(a, s, r0, rows, g, scratch);
}
#else
void attend_generic(const AttnArgs& a, const AttnSequence& s, int64_t r0, int64_t rows, int64_t g,
                    float* scratch) {
  attend(a, s, r0, rows, g, scratch);
}
#endif

}  // namespace mlxkv

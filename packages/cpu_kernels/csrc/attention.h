// Causal attention of query rows against per-sequence KV buffers, in one fixed order.
//
// Row r of sequence s sits at absolute position p = positions[s] + (r - first row of s) and
// attends keys 0..p of its sequence's buffer. For each query head h (kv head g = h / (Hq / Hkv)):
//   score[t] = reduce16(fma-chain over d = lane, lane + 16, ... of q[d] * k[t, d]) * scale
//   w[t]     = exp(score[t] - max score), a fixed polynomial (attention_isa.cpp)
//   sum      = reduce16 of 16 lane sums, lane l adding the w[t] with t % 16 == l, ascending
//   out[d]   = (fma-chain over t ascending of w[t] * v[t, d]) * (1 / sum)
// Nothing depends on the other rows, how many positions one call carries, the thread count or
// the instruction set: a row's output is a function of its query and its keys 0..p alone, which is
// what keeps batched decode, speculative verification and chunked prefill exact.
#pragma once

#include <cstdint>

namespace mlxkv {

struct AttnSequence {
  float* keys;    // (Hkv, capacity, D) row-major, the new rows already written
  float* values;  // same shape
  int64_t capacity;
  int64_t position;  // absolute position of the sequence's first row
  int64_t first_row, rows;
};

struct AttnArgs {
  const float* q;  // (R, Hq, D) row-major
  float* out;      // (R, Hq, D) row-major
  const AttnSequence* sequences;
  int64_t num_sequences;
  int64_t heads, kv_heads, dim;
  float scale;
};

// Row r of sequence s and kv head g (its query heads); scratch holds
// (Hq / Hkv) * round_up(positions + 1, 16) floats for the longest row.
void attend_avx512(const AttnArgs& a, const AttnSequence& s, int64_t r, int64_t g,
                   float* scratch);
void attend_avx2(const AttnArgs& a, const AttnSequence& s, int64_t r, int64_t g,
                 float* scratch);
void attend_generic(const AttnArgs& a, const AttnSequence& s, int64_t r, int64_t g,
                    float* scratch);

// Every row and head, on the thread pool with the selected instruction set.
void attention_run(const AttnArgs& a);

}  // namespace mlxkv

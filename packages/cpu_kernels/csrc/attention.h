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

// Rows of one sequence attended together for one kv head (a prefill chunk, a speculative round):
// they share each key and value load, so a long context leaves memory once per block of rows.
constexpr int64_t kAttnRowBlock = 8;

// Rows r0 .. r0 + rows - 1 (at most kAttnRowBlock) of sequence s and kv head g (their query
// heads); scratch holds rows * (Hq / Hkv) * round_up(positions the last row attends, 16) floats.
// Where the instruction set's kernel attends the block's heads together (attention_isa.cpp),
// each key and value is loaded once for all of them; every row's output is what it is alone.
void attend_avx512(const AttnArgs& a, const AttnSequence& s, int64_t r0, int64_t rows, int64_t g,
                   float* scratch);
void attend_avx2(const AttnArgs& a, const AttnSequence& s, int64_t r0, int64_t rows, int64_t g,
                 float* scratch);
void attend_generic(const AttnArgs& a, const AttnSequence& s, int64_t r0, int64_t rows, int64_t g,
                    float* scratch);

// Every row and head, on the thread pool with the selected instruction set.
void attention_run(const AttnArgs& a);

}  // namespace mlxkv

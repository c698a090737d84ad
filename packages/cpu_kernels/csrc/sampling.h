// Seeded sampling of one token per row of log-probabilities (a request at temperature > 0), the
// same filters as mlx-lm's sampler, each on what the one before it kept:
//   top_k > 0   the k largest (ties: the lower token id first)                  (apply_top_k)
//   min_p > 0   x >= max + log(min_p)                                           (apply_min_p)
//   top_p < 1   walking the kept tokens from the largest (ties: lower id first), a token stays
//               while the mass before it is < top_p * the kept mass (mass: exp(x)); every
//               token >= the last one that stays is kept                         (apply_top_p)
// then the inverse CDF: weights exp((x - max) * inv_temperature) of the kept tokens (exp16.h),
// summed in double in token order; the token is the first whose running sum exceeds u * sum,
// u = (word >> 11) * 2^-53 from the row's 64-bit word. Scalar IEEE arithmetic, exp16 and fixed
// orders (top-p's masses are summed in the order its selection leaves them, the same in every
// run): the same token on every instruction set and thread count, a row's token its own.
#pragma once

#include <cstdint>

namespace mlxkv {

struct SampleArgs {
  float inv_temperature;
  int64_t top_k;  // 0: off
  float top_p;  // 1: off
  float min_p;  // 0: off
};

// All rows (n log-probabilities each) on the thread pool; words[r] is row r's random word.
void sample_run(const float* x, const uint64_t* words, uint32_t* out, int64_t rows, int64_t n, const SampleArgs& args);

}  // namespace mlxkv

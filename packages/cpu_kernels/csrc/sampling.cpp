#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "activations.h"
#include "qmm.h"

namespace mlxkv {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kSortBelow = 64;  // top-p sorts its candidates once this few are left to search

using ExpFn = void (*)(const float*, float*, int64_t);

// Larger value first, ties by the lower token id: a strict total order, so every partial sort
// below picks the same tokens whatever the algorithm's internals.
struct Before {
  const float* x;
  bool operator()(int32_t a, int32_t b) const { return x[a] > x[b] || (x[a] == x[b] && a < b); }
};

// The k-th largest of x[0..n) (0 < k < n), exactly. The k largest maxima of kBlock-token blocks
// are k distinct tokens, so the k-th largest token is at least the k-th largest block maximum:
// only the tokens from there up are selected among (typically a few hundred, not the vocabulary).
float kth_largest(const float* x, int64_t n, int64_t k, float* scratch) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  float floor = kNegInf;
  if (blocks > k) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t end = std::min(n, (b + 1) * kBlock);
      float top = x[b * kBlock];
      for (int64_t i = b * kBlock + 1; i < end; ++i) top = x[i] > top ? x[i] : top;
      scratch[b] = top;
    }
    std::nth_element(scratch, scratch + k - 1, scratch + blocks, std::greater<float>());
    floor = scratch[k - 1];
  }
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i)
    if (x[i] >= floor) scratch[m++] = x[i];
  std::nth_element(scratch, scratch + k - 1, scratch + m, std::greater<float>());
  return scratch[k - 1];
}

// keep[i] = x[i] for the tokens the filters keep, -inf for the others. order: n ids of scratch.
void filter(const float* x, int64_t n, float top, const SampleArgs& a, float* keep, float* mass, int32_t* order,
            ExpFn exp_n) {
  std::copy(x, x + n, keep);
  if (a.top_k > 0 && a.top_k < n) {  // the k-th largest value, then ties at it in token order
    const float kth = kth_largest(x, n, a.top_k, mass);
    int64_t ties = a.top_k;
    for (int64_t i = 0; i < n; ++i) ties -= x[i] > kth;
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] > kth) continue;
      if (x[i] == kth && ties > 0) {
        --ties;
        continue;
      }
      keep[i] = kNegInf;
    }
  }
  if (a.min_p > 0) {
    const float floor = top + float(std::log(double(a.min_p)));
    for (int64_t i = 0; i < n; ++i) keep[i] = keep[i] < floor ? kNegInf : keep[i];
  }
  if (a.top_p < 1) {
    exp_n(keep, mass, n);  // only the kept tokens' entries are read
    double total = 0;
    for (int64_t i = 0; i < n; ++i) total += keep[i] > kNegInf ? mass[i] : 0.0;
    // Tokens lighter than `light` together weigh under half of (1 - top_p) * total: the mass above
    // the first of them is past top_p * total by a margin no rounding closes, so none of them
    // stays and the search leaves them out (most of a peaked distribution's vocabulary).
    const double light = 0.5 * (1.0 - double(a.top_p)) * total / double(n);
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
      if (keep[i] > kNegInf && double(mass[i]) >= light) order[m++] = int32_t(i);
    const double bound = double(a.top_p) * total;
    // The last rank that stays, R, lies in [lo, hi); `before` is the mass of the ranks before lo.
    // Halve the range by selection (expected linear time: a flat distribution keeps most of the
    // vocabulary), then sort what is left and walk it.
    int64_t lo = 0, hi = m;
    double before = 0;
    while (hi - lo > kSortBelow) {
      const int64_t mid = lo + (hi - lo) / 2;
      std::nth_element(order + lo, order + mid, order + hi, Before{x});
      double upto = before;
      for (int64_t r = lo; r < mid; ++r) upto += mass[order[r]];
      if (upto < bound) {
        lo = mid;  // rank mid stays
        before = upto;
      } else {
        hi = mid;  // rank mid goes
      }
    }
    std::sort(order + lo, order + hi, Before{x});
    int64_t last = lo;
    for (int64_t r = lo; r < hi && before < bound; ++r) {
      last = r;
      before += mass[order[r]];
    }
    const float threshold = x[order[last]];
    for (int64_t i = 0; i < n; ++i) keep[i] = keep[i] < threshold ? kNegInf : keep[i];
  }
}

uint32_t sample_row(const float* x, int64_t n, uint64_t word, const SampleArgs& a, float* keep, float* weight,
                    int32_t* order, ExpFn exp_n) {
  float top = kNegInf;
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] > top) {
      top = x[i];
      best = i;
    }
  }
  if (!(top > kNegInf)) return uint32_t(best);  // nothing to weigh (every token -inf): the first
  filter(x, n, top, a, keep, weight, order, exp_n);
  for (int64_t i = 0; i < n; ++i) weight[i] = keep[i] > kNegInf ? (keep[i] - top) * a.inv_temperature : 0.0f;
  exp_n(weight, weight, n);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (keep[i] == kNegInf) weight[i] = 0.0f;
    total += weight[i];
  }
  const double target = double(word >> 11) * 0x1.0p-53 * total;
  double running = 0;
  int64_t chosen = best;
  for (int64_t i = 0; i < n; ++i) {
    if (weight[i] == 0.0f) continue;
    running += weight[i];
    chosen = i;
    if (running > target) break;  // else (rounding at the very end): the last kept token
  }
  return uint32_t(chosen);
}

}  // namespace

void sample_run(const float* x, const uint64_t* words, uint32_t* out, int64_t rows, int64_t n, const SampleArgs& args) {
  const ExpFn exp_n = for_isa(exp_avx512, exp_avx2, exp_generic);
  int64_t chunks = 1;
  auto plan = [&](int threads) {
    chunks = std::min<int64_t>(rows, threads);
    return rows == 0 || n == 0 ? 0 : chunks;
  };
  auto task = [&](int64_t chunk, int) {
    thread_local std::vector<float> floats;
    thread_local std::vector<int32_t> order;
    floats.resize(size_t(2 * n));
    order.resize(size_t(n));
    for (int64_t r = rows * chunk / chunks; r < rows * (chunk + 1) / chunks; ++r)
      out[r] = sample_row(x + r * n, n, words[r], args, floats.data(), floats.data() + n, order.data(), exp_n);
  };
  pool_run(plan, task);
}

}  // namespace mlxkv

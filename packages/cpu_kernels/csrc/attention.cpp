#include "attention.h"

#include <algorithm>
#include <vector>

#include "qmm.h"

namespace mlxkv {

namespace {

// Multiply-adds below which one thread does everything (a decode step's attention over a short
// context): waking a worker costs more than the work.
constexpr int64_t kMinParallelWork = int64_t(1) << 18;

struct Item {
  const AttnSequence* sequence;
  int64_t row;
};

std::vector<std::vector<float>> scratch;  // per pool thread; guarded by the pool's lock

}  // namespace

void attention_run(const AttnArgs& a) {
  auto attend = for_isa(attend_avx512, attend_avx2, attend_generic);
  std::vector<Item> rows;
  int64_t longest = 0, work = 0;
  for (int64_t i = 0; i < a.num_sequences; ++i) {
    const AttnSequence& s = a.sequences[i];
    for (int64_t r = s.first_row; r < s.first_row + s.rows; ++r) {
      const int64_t n = s.position + (r - s.first_row) + 1;
      longest = std::max(longest, n);
      work += n * a.heads * a.dim * 2;
      rows.push_back({&s, r});
    }
  }
  const int64_t group = a.heads / a.kv_heads, stride = (longest + 15) / 16 * 16;
  const int64_t items = int64_t(rows.size()) * a.kv_heads;
  int64_t chunks = 1;
  auto plan = [&](int threads) {
    if (work >= kMinParallelWork) chunks = std::min<int64_t>(items, int64_t(4) * threads);
    if (int(scratch.size()) < threads) scratch.resize(threads);
    for (auto& s : scratch) {
      if (int64_t(s.size()) < group * stride) s.resize(group * stride);
    }
    return items == 0 ? 0 : chunks;
  };
  auto task = [&](int64_t chunk, int thread) {
    const int64_t i0 = items * chunk / chunks, i1 = items * (chunk + 1) / chunks;
    for (int64_t i = i0; i < i1; ++i) {
      const Item& item = rows[i / a.kv_heads];
      const int64_t g = i % a.kv_heads;
      attend(a, *item.sequence, item.row, g, scratch[thread].data());
    }
  };
  pool_run(plan, task);
}

}  // namespace mlxkv

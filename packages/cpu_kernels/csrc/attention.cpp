#include "attention.h"

#include <algorithm>
#include <vector>

#include "qmm.h"

namespace mlxkv {

namespace {

// Multiply-adds below which one thread does everything (a decode step's attention over a short
// context): waking a worker costs more than the work.
constexpr int64_t kMinParallelWork = int64_t(1) << 18;

// Rows first .. first + rows - 1 of a sequence, for kv head g.
struct Item {
  const AttnSequence* sequence;
  int64_t first, rows, g;
};

std::vector<std::vector<float>> scratch;  // per pool thread; guarded by the pool's lock

}  // namespace

void attention_run(const AttnArgs& a) {
  auto attend = for_isa(attend_avx512, attend_avx2, attend_generic);
  int64_t rows = 0, work = 0;
  for (int64_t i = 0; i < a.num_sequences; ++i) {
    const AttnSequence& s = a.sequences[i];
    rows += s.rows;
    for (int64_t r = 0; r < s.rows; ++r) work += (s.position + r + 1) * a.heads * a.dim * 2;
  }
  const int64_t group = a.heads / a.kv_heads;
  std::vector<Item> items;
  int64_t chunks = 1;
  auto plan = [&](int threads) {
    const bool parallel = work >= kMinParallelWork;
    // Rows per block: up to kAttnRowBlock, fewer where that leaves a thread short of about four
    // items (a speculative round's 7 rows in one block a kv head: 3 items for 2 threads).
    const int64_t want = parallel ? int64_t(4) * threads : 1;
    const int64_t block = std::clamp<int64_t>(rows * a.kv_heads / want, 1, kAttnRowBlock);
    // Each sequence's kv heads in turn, its rows in blocks under each: a thread's consecutive
    // items read the same keys and values.
    int64_t scratch_floats = 0;
    for (int64_t i = 0; i < a.num_sequences; ++i) {
      const AttnSequence& s = a.sequences[i];
      for (int64_t g = 0; g < a.kv_heads; ++g) {
        for (int64_t r = 0; r < s.rows; r += block) {
          const int64_t n = std::min(block, s.rows - r);
          const int64_t last = s.position + r + n;  // positions the block's last row attends
          scratch_floats = std::max(scratch_floats, n * group * ((last + 15) / 16 * 16));
          items.push_back({&s, s.first_row + r, n, g});
        }
      }
    }
    const int64_t count = int64_t(items.size());
    if (parallel) chunks = std::min<int64_t>(count, want);
    if (int(scratch.size()) < threads) scratch.resize(threads);
    for (auto& s : scratch) {
      if (int64_t(s.size()) < scratch_floats) s.resize(scratch_floats);
    }
    return count == 0 ? 0 : chunks;
  };
  auto task = [&](int64_t chunk, int thread) {
    const int64_t count = int64_t(items.size());
    const int64_t i0 = count * chunk / chunks, i1 = count * (chunk + 1) / chunks;
    for (int64_t i = i0; i < i1; ++i) {
      const Item& item = items[i];
      attend(a, *item.sequence, item.first, item.rows, item.g, scratch[thread].data());
    }
  };
  pool_run(plan, task);
}

}  // namespace mlxkv

#include "low_rank.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "floats.h"
#include "mlx/backend/cpu/encoder.h"
#include "primitive.h"
#include "qmm.h"

namespace mlxkv {

void low_rank_run(const float* x, int64_t K, float* y, int64_t N, const float* a_t, const float* b, int64_t rank,
                  float scale, const int* rows, int64_t count) {
  thread_local std::vector<float> scratch;
  const int64_t kp = (K + 15) / 16 * 16;
  scratch.resize(size_t((rank + 1) * kp + rank + N));
  for_isa(low_rank_avx512, low_rank_avx2, low_rank_generic)(x, K, y, N, a_t, b, rank, scale, rows, count, scratch.data());
}

namespace {

void fail_unless(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("low_rank: " + message);
}

}  // namespace

void check_low_ranks(int64_t rows, int64_t k, int64_t n, const mx::array& a_t, const mx::array& b, const LowRank& delta,
                     const char* op) {
  auto fail = [op](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(std::string(op) + ": " + message);
  };
  fail(a_t.dtype() == mx::float32 && b.dtype() == mx::float32 && a_t.ndim() == 2 && b.ndim() == 2,
       "low-rank a_t and b must be 2-D float32");
  fail(a_t.shape(1) == k && a_t.shape(0) > 0 && b.shape(0) == a_t.shape(0) && b.shape(1) == n,
       "low-rank a_t must be (rank, " + std::to_string(k) + ") and b (rank, " + std::to_string(n) + ")");
  for (int r : delta.rows) fail(r >= 0 && r < rows, "low-rank row " + std::to_string(r) + " is outside 0.." + std::to_string(rows - 1));
}

mx::array low_rank(const mx::array& y, const mx::array& x, const std::vector<mx::array>& a, const std::vector<mx::array>& b,
                   std::vector<LowRank> deltas, mx::StreamOrDevice s) {
  fail_unless(x.dtype() == mx::float32 && y.dtype() == mx::float32, "x and y must be float32");
  fail_unless(x.ndim() >= 1 && y.ndim() >= 1 && x.shape().back() > 0 && y.shape().back() > 0, "x and y need a non-empty last axis");
  const int64_t k = x.shape().back(), n = y.shape().back(), rows = int64_t(x.size()) / k;
  fail_unless(int64_t(y.size()) / n == rows, "x and y must hold the same rows");
  fail_unless(a.size() == deltas.size() && b.size() == deltas.size(), "need one a, one b and one entry of rows per delta");
  auto stream = mx::to_stream(s);
  fail_unless(stream.device == mx::Device::cpu, "the native kernel runs on the CPU device only");
  std::vector<mx::array> inputs{y, x};
  for (size_t i = 0; i < deltas.size(); ++i) {
    check_low_ranks(rows, k, n, a[i], b[i], deltas[i], "low_rank");
    deltas[i].rank = a[i].shape(0);
    for (const auto* m : {&a[i], &b[i]}) {
      inputs.push_back(m->status() != mx::array::unscheduled && m->flags().row_contiguous ? *m : mx::contiguous(*m, false, stream));
    }
  }
  return mx::array(y.shape(), mx::float32, std::make_shared<NativeLowRank>(stream, std::move(deltas)), std::move(inputs));
}

void NativeLowRank::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  std::vector<const float*> factors;
  for (size_t i = 2; i < inputs.size(); ++i) factors.push_back(inputs[i].data<float>());
  const int64_t k = inputs[1].shape().back(), n = inputs[0].shape().back();
  encoder.dispatch([y = Floats::of(inputs[0]), x = Floats::of(inputs[1]), out = out.data<float>(), factors, deltas = deltas_, k,
                    n]() {
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(x.dense ? 0 : x.size));
    const float* xd = x.read(scratch.data());
    if (y.dense) {
      std::copy(y.data, y.data + y.size, out);
    } else {
      gather(y.data, y.shape, y.strides, out);
    }
    for (size_t i = 0; i < deltas.size(); ++i) {
      const LowRank& d = deltas[i];
      low_rank_run(xd, k, out, n, factors[2 * i], factors[2 * i + 1], d.rank, d.scale, d.rows.data(), int64_t(d.rows.size()));
    }
  });
}

void NativeLowRank::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxkvNativeLowRank has no GPU implementation");
}

std::vector<mx::Shape> NativeLowRank::output_shapes(const std::vector<mx::array>& inputs) { return {inputs[0].shape()}; }

bool NativeLowRank::is_equivalent(const mx::Primitive& other) const {
  return deltas_ == static_cast<const NativeLowRank&>(other).deltas_;
}

}  // namespace mlxkv

// The MLX primitive wrapping the native quantized matmul (CPU only).
#pragma once

#include <array>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "sampling.h"

namespace mlxkv {

namespace mx = mlx::core;

// y = x @ dequant(w, scales, biases)^T, MLX's affine layout; x float32 of shape (..., K).
mx::array quantized_matmul(
    const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
    int group_size, int bits, mx::StreamOrDevice s = {});

// x times each weight (the same bits as one quantized_matmul each), run as one job: inputs are
// x, then each weight's (w, scales, biases); one output per weight.
std::vector<mx::array> quantized_matmuls(
    const mx::array& x, const std::vector<mx::array>& w, const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases, int group_size, int bits, mx::StreamOrDevice s = {});

class NativeQuantizedMatmul : public mx::Primitive {
 public:
  NativeQuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxkvNativeQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
};

// One adapter's low-rank delta (low_rank.h) on some rows of a product: which product of a decoder
// layer (0..6: q, k, v, o, gate, up, down; low_rank: 0), its scale, its rank (set from a_t's shape
// when the op is built) and the rows (indices into the product's rows) it adds to.
struct LowRank {
  int product = 0;
  float scale = 1.0f;
  int rank = 0;
  std::vector<int> rows;
  bool operator==(const LowRank&) const = default;
};

// Throws std::invalid_argument (naming `op`) unless a_t is (rank, k), b (rank, n), both float32,
// and the delta's rows lie in 0..rows-1.
void check_low_ranks(int64_t rows, int64_t k, int64_t n, const mx::array& a_t, const mx::array& b, const LowRank& delta,
                     const char* op);

// y + each delta i (a_t[i] = a^T, b[i]) on its rows of x, in order: the bits of MLX's
// `y + scale * ((x @ a) @ b)` over the fixed-order BLAS shim, per row. x (..., K) and y (..., N)
// float32 with the same rows.
mx::array low_rank(const mx::array& y, const mx::array& x, const std::vector<mx::array>& a, const std::vector<mx::array>& b,
                   std::vector<LowRank> deltas, mx::StreamOrDevice s = {});

class NativeLowRank : public mx::Primitive {
 public:
  NativeLowRank(mx::Stream stream, std::vector<LowRank> deltas) : mx::Primitive(stream), deltas_(std::move(deltas)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxkvNativeLowRank"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  std::vector<LowRank> deltas_;
};

// RoPE the kernel applies to q and k first: the first `dims` features of each head rotate by
// theta_i = (position * scale) * inv_freq[i], i < dims / 2, pairing (i, i + dims / 2), or
// (2i, 2i + 1) when `traditional` (mx.fast.rope's conventions); dims = 0: q and k come rotated.
struct Rope {
  int dims = 0;
  bool traditional = false;
  float scale = 1.0f;
  bool operator==(const Rope&) const = default;
};

// Writes each sequence's new keys and values into its buffers, then attends causally (see
// attention.h). q (R, Hq, D) or (..., Hq * D) with the R rows in the leading dims (the same
// row-major floats: a projection's output goes in as it is), k and v likewise with Hkv heads,
// float32; positions int32 (S,), the absolute position of each sequence's first row; buffers: S
// (keys, values) pairs of shape (1, Hkv, capacity, D) float32 with capacity >= position + rows
// (they give Hkv and D); rows[s] consecutive rows per sequence; inv_freq float32 (rope.dims / 2,)
// when rope.dims > 0. Returns [out (q's shape), keys_0, values_0, ...]: the buffers with the rows
// written (in place when MLX can donate them, otherwise copies).
std::vector<mx::array> attend(
    const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& positions,
    const std::vector<mx::array>& buffers, std::vector<int> rows, float scale, const mx::array& inv_freq,
    Rope rope, mx::StreamOrDevice s = {});

class NativeAttention : public mx::Primitive {
 public:
  NativeAttention(mx::Stream stream, std::vector<int> rows, float scale, Rope rope)
      : mx::Primitive(stream), rows_(std::move(rows)), scale_(scale), rope_(rope) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxkvNativeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  std::vector<int> rows_;
  float scale_;
  Rope rope_;
};

// How each of a decoder layer's four products is quantized: q/k/v, o, gate/up, down.
struct LayerQuant {
  std::array<int, 4> bits{};
  std::array<int, 4> group_size{};
  bool operator==(const LayerQuant&) const = default;
};

// One llama-style decoder layer in one primitive, the same operations in the same order as the
// separate ones (so the same bits), without ~10 graph nodes a layer:
//   a = rms_norm(h, input_norm, eps); q, k, v = a @ Wq, Wk, Wv; att = attend(q, k, v, ...)
//   h1 = h + att @ Wo; b = rms_norm(h1, post_norm, eps); out = h1 + swiglu(b @ Wg, b @ Wu) @ Wd
// h float32 (..., D); weights: (w, scales, biases) for q, k, v, o, gate, up, down in that order
// (21 arrays, MLX's affine layout, no bias); head_norms: none, or the q and k norms' weights
// (head size,) applied to each head of q and k before RoPE (Qwen3); positions, buffers, rows,
// scale, inv_freq and rope as attend takes them; low_ranks: (a_t, b) per delta, each delta added to
// its product's output rows before anything reads them (LoRA adapters: a row's delta is the bits
// low_rank gives it). Returns [out (h's shape), keys_0, values_0, ...] like attend.
std::vector<mx::array> decoder_layer(
    const mx::array& h, const mx::array& input_norm, const mx::array& post_norm, float eps,
    const std::vector<mx::array>& weights, LayerQuant quant, const std::vector<mx::array>& head_norms,
    const mx::array& positions, const std::vector<mx::array>& buffers, std::vector<int> rows, float scale,
    const mx::array& inv_freq, Rope rope, const std::vector<mx::array>& low_ranks = {},
    std::vector<LowRank> deltas = {}, mx::StreamOrDevice s = {});

class NativeDecoderLayer : public mx::Primitive {
 public:
  NativeDecoderLayer(mx::Stream stream, float eps, LayerQuant quant, bool head_norms, std::vector<int> rows, float scale,
                     Rope rope, std::vector<LowRank> deltas)
      : mx::Primitive(stream), eps_(eps), quant_(quant), head_norms_(head_norms), rows_(std::move(rows)), scale_(scale),
        rope_(rope), deltas_(std::move(deltas)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxkvNativeDecoderLayer"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
  LayerQuant quant_;
  bool head_norms_;  // q and k norms' weights follow the 21 weight arrays
  std::vector<int> rows_;
  float scale_;
  Rope rope_;
  std::vector<LowRank> deltas_;  // their (a, b) follow the head norms' weights
};

// The gated MLP activations, act(gate) * up elementwise (activations.h); gate and up float32 of one shape.
enum class Gate { silu, gelu_tanh };

// silu(gate) * up: SwiGLU.
mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});
// gelu_tanh(gate) * up: GeGLU with the tanh-approximate GELU (Gemma's MLP).
mx::array geglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

class NativeGated : public mx::Primitive {
 public:
  NativeGated(mx::Stream stream, Gate gate) : mx::Primitive(stream), gate_(gate) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return gate_ == Gate::silu ? "MlxkvNativeSwiglu" : "MlxkvNativeGeglu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return gate_ == static_cast<const NativeGated&>(other).gate_;
  }

 private:
  Gate gate_;
};

// RMS normalization over the last axis times weight (activations.h); x float32 of shape (..., n),
// weight float32 of shape (n,).
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s = {});

class NativeRmsNorm : public mx::Primitive {
 public:
  NativeRmsNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxkvNativeRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const NativeRmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

// x - logsumexp(x) over the last axis (activations.h); x float32.
mx::array log_softmax(const mx::array& x, mx::StreamOrDevice s = {});

class NativeLogSoftmax : public mx::Primitive {
 public:
  explicit NativeLogSoftmax(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxkvNativeLogSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// One token per row of log-probabilities x (..., V) float32, from words (rows,) uint64, after the
// top-k, min-p and top-p filters (sampling.h); uint32 of shape x.shape[:-1].
mx::array sample(const mx::array& x, const mx::array& words, float inv_temperature, int top_k, float top_p,
                 float min_p, mx::StreamOrDevice s = {});

class NativeSample : public mx::Primitive {
 public:
  NativeSample(mx::Stream stream, SampleArgs args) : mx::Primitive(stream), args_(args) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxkvNativeSample"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  SampleArgs args_;
};

}  // namespace mlxkv

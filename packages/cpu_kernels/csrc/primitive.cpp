#include "primitive.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention.h"
#include "mlx/backend/cpu/encoder.h"
#include "low_rank.h"
#include "qmm.h"
#include "activations.h"
#include "floats.h"

namespace mlxkv {

namespace {

void check(bool ok, const std::string& message, const char* op = "quantized_matmul") {
  if (!ok) throw std::invalid_argument(std::string(op) + ": " + message);
}

// Allocates a primitive's one output and registers it and the inputs with the stream's CPU
// encoder, which it returns to dispatch the kernel on.
mx::cpu::CommandEncoder& encode_one_output(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  return encoder;
}

// attend's inputs: q, k, v, positions, inv_freq, then the buffers.
constexpr size_t kFirstBuffer = 5;

// RoPE of one row's `heads` heads in place (see Rope in primitive.h).
void rotate(const Rope& rope, const float* inv_freq, int64_t position, float* row, int64_t heads, int64_t dim) {
  const int half = rope.dims / 2;
  thread_local std::vector<float> cos_sin;
  cos_sin.resize(size_t(2 * half));
  for (int i = 0; i < half; ++i) {
    const float theta = (float(position) * rope.scale) * inv_freq[i];
    cos_sin[2 * i] = std::cos(theta);
    cos_sin[2 * i + 1] = std::sin(theta);
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* x = row + h * dim;
    for (int i = 0; i < half; ++i) {
      float* a = rope.traditional ? x + 2 * i : x + i;
      float* b = rope.traditional ? x + 2 * i + 1 : x + i + half;
      const float c = cos_sin[2 * i], sn = cos_sin[2 * i + 1];
      const float x1 = *a, x2 = *b;
      *a = x1 * c - x2 * sn;
      *b = x1 * sn + x2 * c;
    }
  }
}

// A sequence's KV buffer as attend's task sees it: the output it writes (the input's own memory
// when donated, else a copy made in the task).
struct KvBuffer {
  const float* src;
  float* dst;
  mx::Shape shape;
  mx::Strides strides;
  bool copy, dense;
  int64_t size;
};

// What attend_task needs besides q, k and v: captured at eval_cpu, run in the dispatched task.
struct AttendJob {
  std::vector<KvBuffer> buffers;
  std::vector<int> rows;
  // Read in the task (the inputs are computed by then, not at eval_cpu), each 1-D with its own
  // stride: a broadcast or strided view reads right.
  const int32_t* positions;
  int64_t positions_stride;
  const float* inv_freq;
  int64_t inv_freq_stride;
  float scale;
  Rope rope;
  int64_t heads, kv_heads, dim;
};

struct KvGeometry {
  int heads, dim, rows;  // kv heads, head size, rows over all sequences
};

// Checks what attend and decoder_layer share (the sequences' buffers, rows, positions and RoPE).
KvGeometry kv_geometry(const mx::array& positions, const std::vector<mx::array>& buffers, const std::vector<int>& rows,
                       const mx::array& inv_freq, const Rope& rope, const char* op) {
  auto fail = [op](bool ok, const std::string& message) { check(ok, message, op); };
  fail(!rows.empty() && buffers.size() == 2 * rows.size(), "need a keys and a values buffer per sequence");
  for (const auto& b : buffers) {
    fail(b.dtype() == mx::float32 && b.ndim() == 4 && b.shape(0) == 1 && b.shape(1) > 0 && b.shape(2) > 0 &&
             b.shape(1) == buffers[0].shape(1) && b.shape(3) == buffers[0].shape(3),
         "buffers must be float32 of shape (1, Hkv, capacity, D), capacity > 0");
  }
  for (size_t s = 0; s + 1 < buffers.size(); s += 2) {
    fail(buffers[s].shape(2) == buffers[s + 1].shape(2), "a sequence's keys and values buffers must have one capacity");
  }
  const int kv_heads = buffers[0].shape(1), dim = buffers[0].shape(3);
  fail(dim > 0 && dim % 16 == 0 && dim <= 256, "head size must be a multiple of 16, at most 256");
  int R = 0;
  for (int n : rows) {
    fail(n >= 1, "each sequence needs at least one row");
    R += n;
  }
  fail(positions.dtype() == mx::int32 && positions.ndim() == 1 && positions.shape(0) == int(rows.size()),
       "positions must be int32 with one entry per sequence");
  fail(rope.dims >= 0 && rope.dims % 2 == 0 && rope.dims <= dim, "rope dims must be even, 0..D");
  fail(inv_freq.dtype() == mx::float32 && inv_freq.ndim() == 1 && inv_freq.shape(0) == rope.dims / 2,
       "inv_freq must be float32 of shape (rope dims / 2,)");
  return {kv_heads, dim, R};
}

void check_query_heads(int heads, int kv_heads, const char* op) {
  check(heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 64,
        "query heads must be a multiple of kv heads, at most 64 per kv head", op);
}

// Checks one quantized weight (w, scales, biases: MLX's affine layout) of a product over
// `features` inputs.
void check_weight(int64_t features, const mx::array& w, const mx::array& scales, const mx::array& biases,
                  int group_size, int bits, const char* op) {
  check(bits == 4 || bits == 8, "bits must be 4 or 8, got " + std::to_string(bits), op);
  check(group_size == 32 || group_size == 64 || group_size == 128,
        "group_size must be 32, 64 or 128, got " + std::to_string(group_size), op);
  check(w.dtype() == mx::uint32 && w.ndim() == 2, "w must be a 2-D uint32 array", op);
  check(scales.dtype() == biases.dtype() && (scales.dtype() == mx::float32 || scales.dtype() == mx::float16),
        "scales and biases must both be float32 or both float16", op);
  const int64_t n = w.shape(0), k = int64_t(w.shape(1)) * 32 / bits;
  check(features == k, "x has " + std::to_string(features) + " features, w packs " + std::to_string(k), op);
  check(k % group_size == 0, "features (" + std::to_string(k) + ") must be a multiple of group_size", op);
  const mx::Shape param_shape{int(n), int(k / group_size)};
  check(scales.shape() == param_shape && biases.shape() == param_shape,
        "scales and biases must have shape (N, K / group_size)", op);
}

mx::Shape out_shape(const mx::array& x, const mx::array& w) {
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return shape;
}

}  // namespace

mx::array quantized_matmul(
    const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
    int group_size, int bits, mx::StreamOrDevice s) {
  return quantized_matmuls(x, {w}, {scales}, {biases}, group_size, bits, s)[0];
}

std::vector<mx::array> quantized_matmuls(
    const mx::array& x, const std::vector<mx::array>& ws, const std::vector<mx::array>& all_scales,
    const std::vector<mx::array>& all_biases, int group_size, int bits, mx::StreamOrDevice s) {
  check(x.dtype() == mx::float32, "x must be float32 (cast activations first)");
  check(x.ndim() >= 1, "x must have at least one dimension");
  check(!ws.empty() && all_scales.size() == ws.size() && all_biases.size() == ws.size(),
        "need one or more weights, each with its scales and biases");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "the native kernel runs on the CPU device only");
  // NOTE: the kernel reads row-major buffers, but a Contiguous node per input would add four graph
  // nodes to every product (~800 to a decode step). Weights are evaluated and dense already; x,
  // unevaluated here, is gathered in eval_cpu when it turns out strided.
  auto dense = [&](const mx::array& a) {
    return a.status() != mx::array::unscheduled && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream);
  };
  std::vector<mx::array> inputs{x};
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < ws.size(); ++i) {
    const mx::array &w = ws[i], &scales = all_scales[i], &biases = all_biases[i];
    check_weight(x.shape().back(), w, scales, biases, group_size, bits, "quantized_matmul");
    check(scales.dtype() == all_scales[0].dtype(), "every weight's scales must have the same dtype");
    inputs.insert(inputs.end(), {dense(w), dense(scales), dense(biases)});
    shapes.push_back(out_shape(x, w));
  }
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(ws.size(), mx::float32),
                                std::make_shared<NativeQuantizedMatmul>(stream, group_size, bits), std::move(inputs));
}

void NativeQuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  std::vector<QmmArgs> products;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const mx::array& w = inputs[1 + 3 * i];
    const mx::array& scales = inputs[2 + 3 * i];
    mx::array& out = outputs[i];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    QmmArgs args{};
    args.x = x.data<float>();
    args.w = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
    args.scales = scales.data<void>();
    args.biases = inputs[3 + 3 * i].data<void>();
    args.scales_f16 = scales.dtype() == mx::float16;
    args.y = out.data<float>();
    args.K = x.shape().back();
    args.M = args.K == 0 ? 0 : int64_t(x.size()) / args.K;
    args.N = w.shape(0);
    args.group_size = group_size_;
    args.bits = bits_;
    products.push_back(args);
  }
  if (x.flags().row_contiguous) {
    encoder.dispatch([products = std::move(products)]() { qmm_run(products.data(), int(products.size())); });
    return;
  }
  encoder.dispatch([products = std::move(products), shape = x.shape(), strides = x.strides()]() mutable {
    thread_local std::vector<float> dense_x;
    const QmmArgs& first = products[0];
    dense_x.resize(size_t(first.M * first.K));
    gather(first.x, shape, strides, dense_x.data());
    for (auto& a : products) a.x = dense_x.data();
    qmm_run(products.data(), int(products.size()));
  });
}

void NativeQuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxkvNativeQuantizedMatmul has no GPU implementation; use mx.quantized_matmul");
}

std::vector<mx::Shape> NativeQuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (size_t i = 1; i < inputs.size(); i += 3) shapes.push_back(out_shape(inputs[0], inputs[i]));
  return shapes;
}

bool NativeQuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const NativeQuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

std::vector<mx::array> attend(
    const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& positions,
    const std::vector<mx::array>& buffers, std::vector<int> rows, float scale, const mx::array& inv_freq,
    Rope rope, mx::StreamOrDevice s) {
  auto fail = [](bool ok, const std::string& message) { check(ok, message, "attend"); };
  fail(q.dtype() == mx::float32 && k.dtype() == mx::float32 && v.dtype() == mx::float32,
       "q, k and v must be float32");
  const KvGeometry kv = kv_geometry(positions, buffers, rows, inv_freq, rope, "attend");
  const int kv_heads = kv.heads, dim = kv.dim, R = kv.rows;
  // (R, H, D) per head, or (..., H * D) with the R rows in the leading dims: the same row-major floats.
  auto rows_of = [&](const mx::array& a, int h) {
    if (a.ndim() < 1 || int64_t(a.size()) != int64_t(R) * h * dim) return false;
    return (a.ndim() >= 2 && a.shape(-2) == h && a.shape(-1) == dim) || a.shape(-1) == h * dim;
  };
  fail(v.shape() == k.shape() && rows_of(k, kv_heads),
       "k and v must be (R, Hkv, D) or (..., Hkv * D), where the rows per sequence add up to R and the buffers "
       "are (1, Hkv, capacity, D)");
  const int heads = int(q.size() / (size_t(R) * dim));
  fail(rows_of(q, heads), "q must be (R, Hq, D) or (..., Hq * D) with R rows in the leading dims");
  check_query_heads(heads, kv_heads, "attend");
  std::vector<mx::Shape> shapes{q.shape()};
  std::vector<mx::Dtype> dtypes{mx::float32};
  for (const auto& b : buffers) {
    shapes.push_back(b.shape());
    dtypes.push_back(mx::float32);
  }
  auto stream = mx::to_stream(s);
  fail(stream.device == mx::Device::cpu, "the native kernel runs on the CPU device only");
  std::vector<mx::array> inputs{q, k, v, positions, inv_freq};
  inputs.insert(inputs.end(), buffers.begin(), buffers.end());
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<NativeAttention>(stream, std::move(rows), scale, rope), inputs);
}

namespace {

// Every output of a multi-output primitive holds its own copy of the inputs, so no buffer would
// ever look donatable (is_donatable wants one reference). MLX drops the siblings' inputs right
// after eval_cpu anyway (array::detach); dropping them first leaves a buffer with one reference
// exactly when nothing else (a Python handle, a clone) still holds it.
void release_sibling_inputs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  if (std::none_of(outputs.begin(), outputs.end(), [](const mx::array& o) { return o.is_tracer(); })) {
    for (auto& o : outputs) {
      if (&o.inputs() != &inputs) o.inputs().clear();
    }
  }
}

// Outputs out_first.. take the KV buffers inputs in_first.. in place where MLX can donate them,
// fresh memory (filled by the task) otherwise.
std::vector<KvBuffer> kv_outputs(const std::vector<mx::array>& inputs, size_t in_first, std::vector<mx::array>& outputs,
                                 size_t out_first) {
  std::vector<KvBuffer> buffers;
  for (size_t i = in_first; i < inputs.size(); ++i) {
    const mx::array& in = inputs[i];
    mx::array& out = outputs[i - in_first + out_first];
    const bool donate = in.is_donatable() && in.flags().row_contiguous;
    if (donate) {
      out.copy_shared_buffer(in);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    buffers.push_back({in.data<float>(), out.data<float>(), in.shape(), in.strides(), !donate,
                       in.flags().row_contiguous, int64_t(in.size())});
  }
  return buffers;
}

// Copies the buffers not donated, rotates q and k in place (RoPE, when rope.dims > 0), writes each
// sequence's new rows into its buffers and attends causally into out (attention.h).
void attend_task(const AttendJob& job, float* q, float* k, const float* v, float* out) {
  thread_local std::vector<int64_t> positions;
  thread_local std::vector<float> inv_freq;
  positions.resize(job.rows.size());
  for (size_t s = 0; s < job.rows.size(); ++s) positions[s] = job.positions[int64_t(s) * job.positions_stride];
  inv_freq.resize(size_t(job.rope.dims / 2));
  for (int i = 0; i < job.rope.dims / 2; ++i) inv_freq[size_t(i)] = job.inv_freq[i * job.inv_freq_stride];
  for (const auto& b : job.buffers) {
    if (!b.copy) continue;
    if (b.dense) {
      std::memcpy(b.dst, b.src, size_t(b.size) * sizeof(float));
    } else {
      gather(b.src, b.shape, b.strides, b.dst);
    }
  }
  const int64_t heads = job.heads, kv_heads = job.kv_heads, dim = job.dim;
  if (job.rope.dims > 0) {
    int64_t row = 0;
    for (size_t s = 0; s < job.rows.size(); ++s) {
      for (int j = 0; j < job.rows[s]; ++j, ++row) {
        rotate(job.rope, inv_freq.data(), positions[s] + j, q + row * heads * dim, heads, dim);
        rotate(job.rope, inv_freq.data(), positions[s] + j, k + row * kv_heads * dim, kv_heads, dim);
      }
    }
  }
  std::vector<AttnSequence> sequences;
  int64_t first = 0;
  for (size_t s = 0; s < job.rows.size(); ++s) {
    const KvBuffer& kb = job.buffers[2 * s];
    const KvBuffer& vb = job.buffers[2 * s + 1];
    const int64_t capacity = kb.shape[2];
    // NOTE: the caller reserves the capacity; a position past it (a bug upstream) writes and
    // attends only what fits rather than running off the buffer.
    const int64_t position = std::clamp<int64_t>(positions[s], 0, capacity - 1);
    const int64_t n = std::min<int64_t>(job.rows[s], capacity - position);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t src = ((first + j) * kv_heads + g) * dim, dst = (g * capacity + position + j) * dim;
        std::memcpy(kb.dst + dst, k + src, size_t(dim) * sizeof(float));
        std::memcpy(vb.dst + dst, v + src, size_t(dim) * sizeof(float));
      }
    }
    sequences.push_back({kb.dst, vb.dst, capacity, position, first, n});
    first += job.rows[s];
  }
  AttnArgs args{q, out, sequences.data(), int64_t(sequences.size()), heads, kv_heads, dim, job.scale};
  attention_run(args);
}

// What attend's and decoder_layer's eval_cpu share: registers the inputs and outputs with the
// stream's encoder, allocates output 0, gives outputs 1.. the KV buffers (inputs from
// `buffers_at`, donated where they can be), and returns attend_task's job (positions and inv_freq
// at inputs 3 and 4; the caller sets its query heads).
AttendJob encode_attention(mx::cpu::CommandEncoder& encoder, const std::vector<mx::array>& inputs,
                           std::vector<mx::array>& outputs, size_t buffers_at, const std::vector<int>& rows, float scale,
                           Rope rope) {
  release_sibling_inputs(inputs, outputs);
  for (const auto& in : inputs) encoder.set_input_array(in);
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  std::vector<KvBuffer> buffers = kv_outputs(inputs, buffers_at, outputs, 1);
  for (auto& out : outputs) encoder.set_output_array(out);
  const mx::array &positions = inputs[3], &inv_freq = inputs[4];
  return {std::move(buffers), rows, positions.data<int32_t>(), positions.strides(0), inv_freq.data<float>(),
          inv_freq.strides(0), scale, rope, 0, inputs[buffers_at].shape(1), inputs[buffers_at].shape(3)};
}

}  // namespace

void NativeAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  AttendJob job = encode_attention(encoder, inputs, outputs, kFirstBuffer, rows_, scale_, rope_);
  int64_t total_rows = 0;
  for (int n : rows_) total_rows += n;
  job.heads = int64_t(inputs[0].size()) / (total_rows * job.dim);
  encoder.dispatch([q = Floats::of(inputs[0]), k = Floats::of(inputs[1]), v = Floats::of(inputs[2]),
                    out = outputs[0].data<float>(), job = std::move(job)]() {
    // q and k rotate in place: in scratch, never in the caller's arrays.
    thread_local std::vector<float> qkv;
    qkv.resize(size_t(q.size + k.size + v.size));
    const float* qd = q.read(qkv.data());
    const float* kd = k.read(qkv.data() + q.size);
    const float* vd = v.read(qkv.data() + q.size + k.size);
    if (job.rope.dims > 0) {
      if (qd != qkv.data()) std::memcpy(qkv.data(), qd, size_t(q.size) * sizeof(float));
      if (kd != qkv.data() + q.size) std::memcpy(qkv.data() + q.size, kd, size_t(k.size) * sizeof(float));
      qd = qkv.data();
      kd = qkv.data() + q.size;
    }
    attend_task(job, const_cast<float*>(qd), const_cast<float*>(kd), vd, out);
  });
}

void NativeAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxkvNativeAttention has no GPU implementation");
}

std::vector<mx::Shape> NativeAttention::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes{inputs[0].shape()};
  for (size_t i = kFirstBuffer; i < inputs.size(); ++i) shapes.push_back(inputs[i].shape());
  return shapes;
}

bool NativeAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const NativeAttention&>(other);
  return rows_ == o.rows_ && scale_ == o.scale_ && rope_ == o.rope_;
}

namespace {

// decoder_layer's inputs: h, the two norms' weights, positions, inv_freq, 21 weight arrays, the q
// and k norms' weights where the layer has them, each low-rank delta's (a, b), buffers.
constexpr size_t kLayerWeights = 5, kHeadNorms = kLayerWeights + 21;
size_t first_low_rank(bool head_norms) { return kHeadNorms + (head_norms ? 2 : 0); }
size_t first_buffer(bool head_norms, size_t deltas) { return first_low_rank(head_norms) + 2 * deltas; }
// The four products' weights, as (first weight, count) among the seven.
constexpr int kProductFirst[4] = {0, 3, 4, 6}, kProductCount[4] = {3, 1, 2, 1};

}  // namespace

std::vector<mx::array> decoder_layer(
    const mx::array& h, const mx::array& input_norm, const mx::array& post_norm, float eps,
    const std::vector<mx::array>& weights, LayerQuant quant, const std::vector<mx::array>& head_norms,
    const mx::array& positions, const std::vector<mx::array>& buffers, std::vector<int> rows, float scale,
    const mx::array& inv_freq, Rope rope, const std::vector<mx::array>& low_ranks, std::vector<LowRank> deltas,
    mx::StreamOrDevice s) {
  constexpr const char* op = "decoder_layer";
  auto fail = [](bool ok, const std::string& message) { check(ok, message, op); };
  fail(h.dtype() == mx::float32 && h.ndim() >= 1 && h.shape().back() > 0, "h must be float32 with a non-empty last axis");
  const int64_t D = h.shape().back();
  for (const auto* norm : {&input_norm, &post_norm}) {
    fail(norm->dtype() == mx::float32 && norm->ndim() == 1 && norm->shape(0) == D, "norm weights must be float32 of shape (D,)");
  }
  fail(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0");
  fail(weights.size() == 21, "weights are (w, scales, biases) for q, k, v, o, gate, up and down: 21 arrays");
  const KvGeometry kv = kv_geometry(positions, buffers, rows, inv_freq, rope, op);
  fail(head_norms.empty() || head_norms.size() == 2, "head_norms are none, or the q and k norms' weights");
  for (const auto& norm : head_norms) {
    fail(norm.dtype() == mx::float32 && norm.ndim() == 1 && norm.shape(0) == kv.dim,
         "head norm weights must be float32 of shape (head size,)");
  }
  fail(int64_t(h.size()) == int64_t(kv.rows) * D, "h must hold one row of D features per row of the sequences");
  auto out_features = [&](int i) { return int64_t(weights[3 * i].shape(0)); };
  for (int i = 0; i < 7; ++i) fail(weights[3 * i].ndim() == 2, "w must be a 2-D uint32 array");
  const int64_t q_features = out_features(0), kv_features = int64_t(kv.heads) * kv.dim, ffn = out_features(4);
  fail(q_features % kv.dim == 0, "q's outputs must be whole heads of the buffers' head size");
  check_query_heads(int(q_features / kv.dim), kv.heads, op);
  fail(out_features(1) == kv_features && out_features(2) == kv_features, "k and v must give Hkv * D outputs each");
  fail(out_features(3) == D && out_features(6) == D && out_features(5) == ffn, "o and down must give D outputs, up as many as gate");
  const int64_t inputs_of[7] = {D, D, D, q_features, D, D, ffn};
  for (int p = 0; p < 4; ++p) {
    for (int i = kProductFirst[p]; i < kProductFirst[p] + kProductCount[p]; ++i) {
      check_weight(inputs_of[i], weights[3 * i], weights[3 * i + 1], weights[3 * i + 2], quant.group_size[p],
                   quant.bits[p], op);
      fail(weights[3 * i + 1].dtype() == weights[3 * kProductFirst[p] + 1].dtype(),
           "weights of one product (q/k/v, gate/up) must have scales of one dtype");
    }
  }
  fail(low_ranks.size() == 2 * deltas.size(), "low_ranks are (a, b) for each delta");
  for (size_t i = 0; i < deltas.size(); ++i) {
    const int p = deltas[i].product;
    fail(p >= 0 && p < 7, "a delta's product is 0..6 (q, k, v, o, gate, up, down), got " + std::to_string(p));
    check_low_ranks(kv.rows, inputs_of[p], out_features(p), low_ranks[2 * i], low_ranks[2 * i + 1], deltas[i], op);
    deltas[i].rank = low_ranks[2 * i].shape(0);
  }
  auto stream = mx::to_stream(s);
  fail(stream.device == mx::Device::cpu, "the native kernel runs on the CPU device only");
  auto dense = [&](const mx::array& a) {
    return a.status() != mx::array::unscheduled && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream);
  };
  std::vector<mx::array> inputs{h, input_norm, post_norm, positions, inv_freq};
  for (const auto& w : weights) inputs.push_back(dense(w));
  inputs.insert(inputs.end(), head_norms.begin(), head_norms.end());
  for (const auto& m : low_ranks) inputs.push_back(dense(m));
  inputs.insert(inputs.end(), buffers.begin(), buffers.end());
  std::vector<mx::Shape> shapes{h.shape()};
  for (const auto& b : buffers) shapes.push_back(b.shape());
  return mx::array::make_arrays(
      std::move(shapes), std::vector<mx::Dtype>(1 + buffers.size(), mx::float32),
      std::make_shared<NativeDecoderLayer>(stream, eps, quant, !head_norms.empty(), std::move(rows), scale, rope,
                                           std::move(deltas)),
      std::move(inputs));
}

void NativeDecoderLayer::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  AttendJob job = encode_attention(encoder, inputs, outputs, first_buffer(head_norms_, deltas_.size()), rows_, scale_,
                                   rope_);
  const mx::array& h = inputs[0];
  const int64_t D = h.shape().back(), R = int64_t(h.size()) / D;
  // No head norms: empty reads (Floats of the h input, never read).
  const Floats q_norm = Floats::of(inputs[head_norms_ ? kHeadNorms : 0]);
  const Floats k_norm = Floats::of(inputs[head_norms_ ? kHeadNorms + 1 : 0]);
  std::array<QmmArgs, 7> products{};
  for (int p = 0; p < 4; ++p) {
    for (int i = kProductFirst[p]; i < kProductFirst[p] + kProductCount[p]; ++i) {
      const mx::array& w = inputs[kLayerWeights + 3 * i];
      QmmArgs& a = products[size_t(i)];
      a.w = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
      a.scales = inputs[kLayerWeights + 3 * i + 1].data<void>();
      a.biases = inputs[kLayerWeights + 3 * i + 2].data<void>();
      a.scales_f16 = inputs[kLayerWeights + 3 * i + 1].dtype() == mx::float16;
      a.M = R;
      a.N = w.shape(0);
      a.K = int64_t(w.shape(1)) * 32 / quant_.bits[p];
      a.group_size = quant_.group_size[p];
      a.bits = quant_.bits[p];
    }
  }
  job.heads = products[0].N / job.dim;
  std::vector<const float*> factors;  // each delta's a and b (dense: see decoder_layer)
  for (size_t i = first_low_rank(head_norms_); i < first_buffer(head_norms_, deltas_.size()); ++i) {
    factors.push_back(inputs[i].data<float>());
  }
  encoder.dispatch([factors = std::move(factors), deltas = deltas_, h = Floats::of(h), input_norm = Floats::of(inputs[1]), post_norm = Floats::of(inputs[2]), q_norm,
                    k_norm, head_norms = head_norms_, out = outputs[0].data<float>(), products, job = std::move(job),
                    eps = eps_, R, D]() mutable {
    const int64_t nq = products[0].N, nkv = products[1].N, ffn = products[4].N, dim = job.dim;
    thread_local std::vector<float> scratch;
    // h (when strided), the norms' weights (when strided), a normed row block, q, k, v, the
    // attention output, o or down's output, gate, up, their SwiGLU, the head norms' weights
    // (when strided) and q and k normed per head.
    const int64_t heads_normed = head_norms ? 1 : 0;
    const int64_t sizes[] = {h.dense ? 0 : R * D, input_norm.dense ? 0 : D, post_norm.dense ? 0 : D, R * D, R * nq,
                             R * nkv, R * nkv, R * nq, R * D, R * ffn, R * ffn, R * ffn,
                             heads_normed * (q_norm.dense ? 0 : dim), heads_normed * (k_norm.dense ? 0 : dim),
                             heads_normed * R * nq, heads_normed * R * nkv};
    int64_t total = 0;
    for (int64_t n : sizes) total += n;
    scratch.resize(size_t(total));
    float* at = scratch.data();
    auto take = [&at](int64_t n) { float* p = at; at += n; return p; };
    const float* hd = h.read(take(sizes[0]));
    const float* w1 = input_norm.read(take(sizes[1]));
    const float* w2 = post_norm.read(take(sizes[2]));
    float *normed = take(R * D), *q = take(R * nq), *k = take(R * nkv), *v = take(R * nkv), *att = take(R * nq),
          *proj = take(R * D), *gate = take(R * ffn), *up = take(R * ffn), *act = take(R * ffn);
    const float* qn = head_norms ? q_norm.read(take(sizes[12])) : nullptr;
    const float* kn = head_norms ? k_norm.read(take(sizes[13])) : nullptr;
    float *q_normed = take(sizes[14]), *k_normed = take(sizes[15]);
    auto run = [&](int first, int count, const float* x, std::initializer_list<float*> ys) {
      int i = first;
      for (float* y : ys) {
        products[size_t(i)].x = x;
        products[size_t(i++)].y = y;
      }
      qmm_run(products.data() + first, count);
      for (size_t d = 0; d < deltas.size(); ++d) {  // adapters' deltas, in order, before anything reads y
        const LowRank& delta = deltas[d];
        if (delta.product < first || delta.product >= first + count) continue;
        const QmmArgs& p = products[size_t(delta.product)];
        low_rank_run(x, p.K, p.y, p.N, factors[2 * d], factors[2 * d + 1], delta.rank, delta.scale, delta.rows.data(),
                     int64_t(delta.rows.size()));
      }
    };
    rms_norm_run(hd, w1, normed, R, D, eps);
    run(0, 3, normed, {q, k, v});
    if (head_norms) {  // each head's q and k normed as rows of the head size, as the separate norms run them
      rms_norm_run(q, qn, q_normed, R * nq / dim, dim, eps);
      rms_norm_run(k, kn, k_normed, R * nkv / dim, dim, eps);
      q = q_normed;
      k = k_normed;
    }
    attend_task(job, q, k, v, att);
    run(3, 1, att, {proj});
    for (int64_t i = 0; i < R * D; ++i) out[i] = hd[i] + proj[i];
    rms_norm_run(out, w2, normed, R, D, eps);
    run(4, 2, normed, {gate, up});
    swiglu_run(gate, up, act, R * ffn);
    run(6, 1, act, {proj});
    for (int64_t i = 0; i < R * D; ++i) out[i] += proj[i];
  });
}

void NativeDecoderLayer::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxkvNativeDecoderLayer has no GPU implementation");
}

std::vector<mx::Shape> NativeDecoderLayer::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes{inputs[0].shape()};
  for (size_t i = first_buffer(head_norms_, deltas_.size()); i < inputs.size(); ++i) shapes.push_back(inputs[i].shape());
  return shapes;
}

bool NativeDecoderLayer::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const NativeDecoderLayer&>(other);
  return eps_ == o.eps_ && quant_ == o.quant_ && head_norms_ == o.head_norms_ && rows_ == o.rows_ &&
         scale_ == o.scale_ && rope_ == o.rope_ && deltas_ == o.deltas_;
}

namespace {

mx::array gated(const mx::array& gate, const mx::array& up, Gate kind, mx::StreamOrDevice s, const char* op) {
  check(gate.dtype() == mx::float32 && up.dtype() == mx::float32, "gate and up must be float32", op);
  check(gate.shape() == up.shape(), "gate and up must have the same shape", op);
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "the native kernel runs on the CPU device only", op);
  return mx::array(gate.shape(), mx::float32, std::make_shared<NativeGated>(stream, kind), {gate, up});
}

}  // namespace

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated(gate, up, Gate::silu, s, "swiglu");
}

mx::array geglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated(gate, up, Gate::gelu_tanh, s, "geglu");
}

void NativeGated::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  auto& encoder = encode_one_output(stream(), inputs, out);
  auto run = gate_ == Gate::silu ? swiglu_run : geglu_run;
  encoder.dispatch([g = Floats::of(inputs[0]), u = Floats::of(inputs[1]), y = out.data<float>(), run]() {
    thread_local std::vector<float> scratch;
    const int64_t n = g.size;
    if (!g.dense || !u.dense) scratch.resize(size_t(2 * n));
    const float* gd = g.read(scratch.data());
    const float* ud = u.read(scratch.data() + n);
    run(gd, ud, y, n);
  });
}

void NativeGated::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string(name()) + " has no GPU implementation");
}

std::vector<mx::Shape> NativeGated::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  check(x.dtype() == mx::float32 && weight.dtype() == mx::float32, "x and weight must be float32", "rms_norm");
  check(x.ndim() >= 1 && x.shape().back() > 0, "x must have a non-empty last axis", "rms_norm");
  check(weight.ndim() == 1 && weight.shape(0) == x.shape().back(), "weight must be of shape (x.shape[-1],)", "rms_norm");
  check(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0", "rms_norm");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "the native kernel runs on the CPU device only", "rms_norm");
  return mx::array(x.shape(), mx::float32, std::make_shared<NativeRmsNorm>(stream, eps), {x, weight});
}

void NativeRmsNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  mx::array& out = outputs[0];
  auto& encoder = encode_one_output(stream(), inputs, out);
  const int64_t n = x.shape().back(), rows = int64_t(x.size()) / n;
  encoder.dispatch([x = Floats::of(x), w = Floats::of(inputs[1]), y = out.data<float>(), rows, n, eps = eps_]() {
    thread_local std::vector<float> scratch;
    scratch.resize(size_t((x.dense ? 0 : x.size) + (w.dense ? 0 : n)));
    const float* xd = x.read(scratch.data());
    const float* wd = w.read(scratch.data() + (x.dense ? 0 : x.size));
    rms_norm_run(xd, wd, y, rows, n, eps);
  });
}

void NativeRmsNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxkvNativeRmsNorm has no GPU implementation");
}

std::vector<mx::Shape> NativeRmsNorm::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

mx::array log_softmax(const mx::array& x, mx::StreamOrDevice s) {
  check(x.dtype() == mx::float32, "x must be float32", "log_softmax");
  check(x.ndim() >= 1 && x.shape().back() > 0, "x must have a non-empty last axis", "log_softmax");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "the native kernel runs on the CPU device only", "log_softmax");
  return mx::array(x.shape(), mx::float32, std::make_shared<NativeLogSoftmax>(stream), {x});
}

void NativeLogSoftmax::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  mx::array& out = outputs[0];
  auto& encoder = encode_one_output(stream(), inputs, out);
  const int64_t n = x.shape().back(), rows = int64_t(x.size()) / n;
  encoder.dispatch([x = Floats::of(x), y = out.data<float>(), rows, n]() {
    thread_local std::vector<float> scratch;
    if (!x.dense) scratch.resize(size_t(x.size));
    log_softmax_run(x.read(scratch.data()), y, rows, n);
  });
}

void NativeLogSoftmax::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxkvNativeLogSoftmax has no GPU implementation");
}

std::vector<mx::Shape> NativeLogSoftmax::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

mx::array sample(const mx::array& x, const mx::array& words, float inv_temperature, int top_k, float top_p,
                 float min_p, mx::StreamOrDevice s) {
  check(x.dtype() == mx::float32, "x must be float32", "sample");
  check(x.ndim() >= 1 && x.shape().back() > 0, "x must have a non-empty last axis", "sample");
  check(words.dtype() == mx::uint64 && words.ndim() == 1 && int64_t(words.size()) * x.shape().back() == int64_t(x.size()),
        "words must be uint64 of shape (rows,), one per row of x", "sample");
  check(std::isfinite(inv_temperature) && inv_temperature > 0, "inv_temperature must be finite and > 0", "sample");
  check(top_k >= 0, "top_k must be >= 0 (0: off)", "sample");
  check(top_p > 0 && top_p <= 1, "top_p must be in (0, 1] (1: off)", "sample");
  check(min_p >= 0 && min_p <= 1, "min_p must be in [0, 1] (0: off)", "sample");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "the native kernel runs on the CPU device only", "sample");
  mx::Shape shape(x.shape().begin(), x.shape().end() - 1);
  SampleArgs args{inv_temperature, top_k, top_p, min_p};
  return mx::array(shape, mx::uint32, std::make_shared<NativeSample>(stream, args), {x, mx::contiguous(words, false, stream)});
}

void NativeSample::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  mx::array& out = outputs[0];
  auto& encoder = encode_one_output(stream(), inputs, out);
  const int64_t n = x.shape().back(), rows = int64_t(x.size()) / n;
  encoder.dispatch([x = Floats::of(x), words = inputs[1].data<uint64_t>(), y = out.data<uint32_t>(), rows, n,
                    args = args_]() {
    thread_local std::vector<float> scratch;
    if (!x.dense) scratch.resize(size_t(x.size));
    sample_run(x.read(scratch.data()), words, y, rows, n, args);
  });
}

void NativeSample::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxkvNativeSample has no GPU implementation");
}

std::vector<mx::Shape> NativeSample::output_shapes(const std::vector<mx::array>& inputs) {
  const mx::Shape& shape = inputs[0].shape();
  return {mx::Shape(shape.begin(), shape.end() - 1)};
}

bool NativeSample::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const NativeSample&>(other).args_;
  return args_.inv_temperature == o.inv_temperature && args_.top_k == o.top_k && args_.top_p == o.top_p &&
         args_.min_p == o.min_p;
}

}  // namespace mlxkv

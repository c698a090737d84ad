#include "primitive.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"

namespace mlxkv {

namespace {

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("quantized_matmul: " + message);
}

// dst = the elements of a strided array, in row-major order.
void gather(const float* src, const mx::Shape& shape, const mx::Strides& strides, float* dst) {
  const int nd = int(shape.size());
  int64_t total = 1;
  for (int d = 0; d < nd; ++d) total *= shape[d];
  std::vector<int64_t> index(nd, 0);
  int64_t offset = 0;
  for (int64_t i = 0; i < total; ++i) {
    dst[i] = src[offset];
    for (int d = nd - 1; d >= 0; --d) {
      if (++index[d] < shape[d]) {
        offset += strides[d];
        break;
      }
      offset -= strides[d] * (shape[d] - 1);
      index[d] = 0;
    }
  }
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
  check(bits == 4 || bits == 8, "bits must be 4 or 8, got " + std::to_string(bits));
  check(group_size == 32 || group_size == 64 || group_size == 128,
        "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  check(x.dtype() == mx::float32, "x must be float32 (cast activations first)");
  check(x.ndim() >= 1, "x must have at least one dimension");
  check(w.dtype() == mx::uint32 && w.ndim() == 2, "w must be a 2-D uint32 array");
  check(scales.dtype() == biases.dtype() && (scales.dtype() == mx::float32 || scales.dtype() == mx::float16),
        "scales and biases must both be float32 or both float16");
  int64_t n = w.shape(0), k = int64_t(w.shape(1)) * 32 / bits;
  check(x.shape().back() == k, "x has " + std::to_string(x.shape().back()) + " features, w packs " +
                                    std::to_string(k));
  mx::Shape param_shape{int(n), int(k / group_size)};
  check(scales.shape() == param_shape && biases.shape() == param_shape,
        "scales and biases must have shape (N, K / group_size)");
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "the native kernel runs on the CPU device only");
  // NOTE: the kernel reads row-major buffers, but a Contiguous node per input would add four graph
  // nodes to every product (~800 to a decode step). Weights are evaluated and dense already; x,
  // unevaluated here, is gathered in eval_cpu when it turns out strided.
  auto dense = [&](const mx::array& a) {
    return a.status() != mx::array::unscheduled && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream);
  };
  std::vector<mx::array> inputs{x, dense(w), dense(scales), dense(biases)};
  return mx::array(out_shape(x, w), mx::float32,
                   std::make_shared<NativeQuantizedMatmul>(stream, group_size, bits), std::move(inputs));
}

void NativeQuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  const mx::array& w = inputs[1];
  const mx::array& scales = inputs[2];
  const mx::array& biases = inputs[3];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);

  QmmArgs args{};
  args.x = x.data<float>();
  args.w = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
  args.scales = scales.data<void>();
  args.biases = biases.data<void>();
  args.scales_f16 = scales.dtype() == mx::float16;
  args.y = out.data<float>();
  args.K = x.shape().back();
  args.M = args.K == 0 ? 0 : int64_t(x.size()) / args.K;
  args.N = w.shape(0);
  args.group_size = group_size_;
  args.bits = bits_;
  if (x.flags().row_contiguous) {
    encoder.dispatch([args]() { qmm_run(args); });
    return;
  }
  encoder.dispatch([args, shape = x.shape(), strides = x.strides()]() {
    thread_local std::vector<float> dense_x;
    dense_x.resize(size_t(args.M * args.K));
    gather(args.x, shape, strides, dense_x.data());
    QmmArgs a = args;
    a.x = dense_x.data();
    qmm_run(a);
  });
}

void NativeQuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MlxkvNativeQuantizedMatmul has no GPU implementation; use mx.quantized_matmul");
}

std::vector<mx::Shape> NativeQuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  return {out_shape(inputs[0], inputs[1])};
}

bool NativeQuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const NativeQuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

}  // namespace mlxkv

// The MLX primitive wrapping the native quantized matmul (CPU only).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxkv {

namespace mx = mlx::core;

// y = x @ dequant(w, scales, biases)^T, MLX's affine layout; x float32 of shape (..., K).
mx::array quantized_matmul(
    const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
    int group_size, int bits, mx::StreamOrDevice s = {});

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

}  // namespace mlxkv

// Reading a primitive's float32 inputs as row-major buffers, whatever their strides.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace mlxkv {

namespace mx = mlx::core;

// dst = the elements of a strided array, in row-major order.
inline void gather(const float* src, const mx::Shape& shape, const mx::Strides& strides, float* dst) {
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

// An input's floats as a kernel reads them (row-major): its own buffer when row-contiguous, else
// gathered into the caller's scratch. Captured by value at eval_cpu, read in the dispatched task.
struct Floats {
  const float* data;
  mx::Shape shape;
  mx::Strides strides;
  bool dense;
  int64_t size;

  static Floats of(const mx::array& a) {
    return {a.data<float>(), a.shape(), a.strides(), a.flags().row_contiguous, int64_t(a.size())};
  }

  const float* read(float* scratch) const {
    if (dense) return data;
    gather(data, shape, strides, scratch);
    return scratch;
  }
};

}  // namespace mlxkv

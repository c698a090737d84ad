#include <algorithm>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "primitive.h"
#include "qmm.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

mlxkv::Isa parse_isa(const std::string& name) {
  if (name == "avx512") return mlxkv::Isa::avx512;
  if (name == "avx2") return mlxkv::Isa::avx2;
  if (name == "generic") return mlxkv::Isa::generic;
  throw std::invalid_argument("isa must be 'avx512', 'avx2' or 'generic', got '" + name + "'");
}

// One LowRank per delta from the Python lists (products empty: every delta on product 0).
std::vector<mlxkv::LowRank> low_rank_deltas(const std::vector<int>& products, const std::vector<float>& scales,
                                            const std::vector<std::vector<int>>& rows, const char* op) {
  if (scales.size() != rows.size() || (!products.empty() && products.size() != scales.size())) {
    throw std::invalid_argument(std::string(op) + ": give each low-rank delta its scale, its rows (and its product)");
  }
  std::vector<mlxkv::LowRank> deltas;
  for (size_t i = 0; i < scales.size(); ++i) deltas.push_back({products.empty() ? 0 : products[i], scales[i], 0, rows[i]});
  return deltas;
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "Native batch-invariant quantized matmul for MLX on CPU";
  mlxkv::hand_pool_to_blas_shim();
  m.def("quantized_matmul", &mlxkv::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "y = x @ dequant(w, scales, biases)^T (MLX affine layout, transpose=True).");
  m.def("quantized_matmuls", &mlxkv::quantized_matmuls, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "[x @ dequant(w[i], scales[i], biases[i])^T for each i] as one job on the kernels' threads: "
        "each output has the bits quantized_matmul gives it alone.");
  m.def(
      "attend",
      [](const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& positions,
         const std::vector<mx::array>& buffers, std::vector<int> rows, float scale,
         const std::optional<mx::array>& inv_freq, int rope_dims, bool rope_traditional, float rope_scale,
         mx::StreamOrDevice s) {
        mlxkv::Rope rope{rope_dims, rope_traditional, rope_scale};
        return mlxkv::attend(q, k, v, positions, buffers, std::move(rows), scale,
                             inv_freq ? *inv_freq : mx::zeros({0}, mx::float32), rope, s);
      },
      "q"_a, "k"_a, "v"_a, "positions"_a, "buffers"_a, "rows"_a, "scale"_a, nb::kw_only(),
      "inv_freq"_a = nb::none(), "rope_dims"_a = 0, "rope_traditional"_a = false, "rope_scale"_a = 1.0f,
      "stream"_a = nb::none(),
      "Rotates q and k (RoPE, when rope_dims > 0), writes each sequence's new k, v rows into its "
      "(1, Hkv, capacity, D) buffers and attends causally. q, k and v are (R, H, D) or (..., H * D) "
      "with the R rows in the leading dims; returns [out (q's shape), keys_0, values_0, ...].");
  m.def(
      "decoder_layer",
      [](const mx::array& h, const mx::array& input_norm, const mx::array& post_norm, float eps,
         const std::vector<mx::array>& weights, const std::vector<int>& bits, const std::vector<int>& group_sizes,
         const std::vector<mx::array>& head_norms, const mx::array& positions, const std::vector<mx::array>& buffers, std::vector<int> rows, float scale,
         const std::optional<mx::array>& inv_freq, int rope_dims, bool rope_traditional, float rope_scale,
         const std::vector<mx::array>& low_ranks, const std::vector<int>& low_rank_products,
         const std::vector<float>& low_rank_scales, const std::vector<std::vector<int>>& low_rank_rows,
         mx::StreamOrDevice s) {
        if (bits.size() != 4 || group_sizes.size() != 4) {
          throw std::invalid_argument("decoder_layer: bits and group_sizes take one entry per product: q/k/v, o, gate/up, down");
        }
        mlxkv::LayerQuant quant;
        std::copy(bits.begin(), bits.end(), quant.bits.begin());
        std::copy(group_sizes.begin(), group_sizes.end(), quant.group_size.begin());
        mlxkv::Rope rope{rope_dims, rope_traditional, rope_scale};
        return mlxkv::decoder_layer(h, input_norm, post_norm, eps, weights, quant, head_norms, positions, buffers,
                                    std::move(rows), scale, inv_freq ? *inv_freq : mx::zeros({0}, mx::float32), rope,
                                    low_ranks,
                                    low_rank_deltas(low_rank_products, low_rank_scales, low_rank_rows, "decoder_layer"), s);
      },
      "h"_a, "input_norm"_a, "post_norm"_a, "eps"_a, "weights"_a, "bits"_a, "group_sizes"_a, "head_norms"_a, "positions"_a,
      "buffers"_a, "rows"_a, "scale"_a, nb::kw_only(), "inv_freq"_a = nb::none(), "rope_dims"_a = 0,
      "rope_traditional"_a = false, "rope_scale"_a = 1.0f, "low_ranks"_a = std::vector<mx::array>{},
      "low_rank_products"_a = std::vector<int>{}, "low_rank_scales"_a = std::vector<float>{},
      "low_rank_rows"_a = std::vector<std::vector<int>>{}, "stream"_a = nb::none(),
      "One llama-style decoder layer (input norm, q/k/v, attend, o, residual, post norm, gate/up, SwiGLU, "
      "down, residual) as one node, with the bits of the separate ops. weights: (w, scales, biases) for q, k, "
      "v, o, gate, up, down; bits and group_sizes: q/k/v, o, gate/up, down; head_norms: [] or the q and k norms' "
      "weights (Qwen3); low_ranks: (a^T, b) of each LoRA delta, added to product low_rank_products[i]'s rows "
      "low_rank_rows[i] times low_rank_scales[i] as low_rank adds it. Returns [h', keys_0, values_0, ...].");
  m.def(
      "low_rank",
      [](const mx::array& y, const mx::array& x, const std::vector<mx::array>& a, const std::vector<mx::array>& b,
         const std::vector<float>& scales, const std::vector<std::vector<int>>& rows, mx::StreamOrDevice s) {
        return mlxkv::low_rank(y, x, a, b, low_rank_deltas({}, scales, rows, "low_rank"), s);
      },
      "y"_a, "x"_a, "a_t"_a, "b"_a, "scales"_a, "rows"_a, nb::kw_only(), "stream"_a = nb::none(),
      "y plus each LoRA delta scales[i] * ((x @ a_t[i].T) @ b[i]) on the rows rows[i] (indices into x's and y's "
      "rows), in order: per row the bits of MLX's y + scale * ((x @ a) @ b) over the fixed-order BLAS shim.");
  m.def("swiglu", &mlxkv::swiglu, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "silu(gate) * up elementwise (float32), the same bits on every instruction set and thread count.");
  m.def("geglu", &mlxkv::geglu, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "gelu_approx(gate) * up elementwise (float32; GELU's tanh approximation as gate * sigmoid(2 * y)), "
        "the same bits on every instruction set and thread count.");
  m.def("rms_norm", &mlxkv::rms_norm, "x"_a, "weight"_a, "eps"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x / sqrt(mean(x * x) + eps) * weight over the last axis (float32), the same bits on every "
        "instruction set and thread count.");
  m.def("log_softmax", &mlxkv::log_softmax, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x - logsumexp(x) over the last axis (float32), the same bits on every instruction set and thread count.");
  m.def("sample", &mlxkv::sample, "x"_a, "words"_a, nb::kw_only(), "inv_temperature"_a, "top_k"_a = 0,
        "top_p"_a = 1.0f, "min_p"_a = 0.0f, "stream"_a = nb::none(),
        "One token id (uint32) per row of log-probabilities x (float32), drawn with the row's uint64 word "
        "after the top-k, min-p and top-p filters; the same token on every instruction set and thread count.");
  m.def("num_threads", &mlxkv::num_threads, "Threads the kernel splits output features over.");
  m.def("set_num_threads", &mlxkv::set_num_threads, "n"_a);
  m.def("isa", [] { return std::string(mlxkv::isa_name(mlxkv::current_isa())); });
  m.def("best_isa", [] { return std::string(mlxkv::isa_name(mlxkv::best_isa())); });
  m.def("set_isa", [](const std::string& name) { mlxkv::set_isa(parse_isa(name)); }, "name"_a);
}

// cblas_sgemm with a fixed reduction order, exported into the global symbol scope ahead of libmlx
// (which otherwise binds its bundled reference BLAS, ~4 GFLOP/s). Every C[i, j] is reduced over K
// exactly as the native quantized kernel does (16 lanes, ascending k, fixed tree), so attention's
// q.k^T and p.v give the same bits whatever M, N or the query chunking: an optimized BLAS such as
// OpenBLAS picks kernels by shape and broke prefill-chunk and compiled-step exactness.
// No mlx, no Python: the loader must not import mlx before this library is loaded.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "qmm.h"

namespace {

enum { kRowMajor = 101, kColMajor = 102, kNoTrans = 111 };

using Dense = void (*)(const mlxkv::QmmArgs&, const float*, int64_t);
using Row = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, float*);

int best() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
    return 3;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 2;
  return 0;
}

const int isa = best();
const Dense dense = isa == 3 ? mlxkv::dense_avx512 : isa == 2 ? mlxkv::dense_avx2 : mlxkv::dense_generic;
const Row row = isa == 3 ? mlxkv::row_avx512 : isa == 2 ? mlxkv::row_avx2 : mlxkv::row_generic;

// Rows of A below this with a row-major B skip packing (the transpose of B costs more than the product).
constexpr int kRowPathMaxM = 4;

void store(float* c, int64_t ldc, int64_t m, int64_t n, const float* dots, float alpha, float beta) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float d = dots[i * n + j];
      float* out = c + i * ldc + j;
      *out = beta == 0.0f ? alpha * d : alpha * d + beta * *out;
    }
  }
}

// Edge of the square tiles a transposing pack copies: a tile's source rows and destination rows
// are each a cache line, where a column-by-column copy read a new line for every element (the
// values of a round's attention, packed once per query head: most of its cost).
constexpr int64_t kPackTile = 16;

// rows x k of op(src) into dst (rows, kp) zero-padded; trans: op(src)[r][c] = src[c * ld + r].
void pack(const float* src, int64_t ld, bool trans, int64_t rows, int64_t k, int64_t kp, float* dst) {
  if (trans) {
    for (int64_t c0 = 0; c0 < k; c0 += kPackTile) {
      const int64_t c1 = std::min(k, c0 + kPackTile);
      for (int64_t r0 = 0; r0 < rows; r0 += kPackTile) {
        const int64_t r1 = std::min(rows, r0 + kPackTile);
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) dst[r * kp + c] = src[c * ld + r];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = dst + r * kp;
    if (!trans) std::memcpy(out, src + r * ld, sizeof(float) * k);
    for (int64_t c = k; c < kp; ++c) out[c] = 0.0f;
  }
}

}  // namespace

extern "C" {

int mlxkv_blas_version() { return 1; }

__attribute__((visibility("default"))) void cblas_sgemm(
    int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
    int ldb, float beta, float* c, int ldc) {
  if (order == kColMajor) {  // C^T = op(B)^T op(A)^T in row-major terms
    std::swap(a, b);
    std::swap(lda, ldb);
    std::swap(ta, tb);
    std::swap(m, n);
  }
  if (m <= 0 || n <= 0) return;
  thread_local std::vector<float> ap, bp, dots, lanes, arow;
  if (m <= kRowPathMaxM && tb == kNoTrans) {
    dots.resize(size_t(m) * n);
    lanes.resize(size_t(16) * n);
    arow.resize(size_t(k));
    for (int64_t i = 0; i < m; ++i) {
      pack(a + (ta == kNoTrans ? i * lda : i), lda, ta != kNoTrans, 1, k, k, arow.data());
      row(arow.data(), k, b, ldb, n, dots.data() + i * n, lanes.data());
    }
    store(c, ldc, m, n, dots.data(), alpha, beta);
    return;
  }
  const int64_t kp = (int64_t(k) + 15) / 16 * 16;
  // Operands already laid out as the kernel reads them (attention's q.k^T: q rows, k rows, head
  // dim a multiple of 16) are read in place: packing the keys was a copy of the cache per call.
  const bool a_in_place = ta == kNoTrans && kp == k && (m == 1 || lda == k);
  const bool b_in_place = tb != kNoTrans && kp == k;
  dots.resize(size_t(m) * n);
  if (!a_in_place) {
    ap.resize(size_t(m) * kp);
    pack(a, lda, ta != kNoTrans, m, k, kp, ap.data());
  }
  if (!b_in_place) {
    bp.resize(size_t(n) * kp);
    // Rows of op(B)^T: op(B)^T[j][l] = op(B)[l][j]; for NoTrans that is b[l * ldb + j] (a transpose).
    pack(b, ldb, tb == kNoTrans, n, k, kp, bp.data());
  }
  mlxkv::QmmArgs args{};
  args.x = a_in_place ? a : ap.data();
  args.y = dots.data();
  args.M = m;
  args.N = n;
  args.K = kp;
  dense(args, b_in_place ? b : bp.data(), b_in_place ? ldb : kp);
  store(c, ldc, m, n, dots.data(), alpha, beta);
}

}  // extern "C"

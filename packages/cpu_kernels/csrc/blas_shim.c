/* Exports the standard cblas_{s,d,c}gemm that libmlx calls and forwards them to numpy's bundled
 * OpenBLAS, whose symbols are prefixed (scipy_...64_) and take 64-bit integers. Loaded into the
 * global symbol scope before libmlx, so libmlx binds to these instead of its reference BLAS.
 * Until mlxkv_blas_bind succeeds, calls go to the next definition (the reference BLAS). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>

typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
typedef void (*dgemm64_t)(int, int, int, int64_t, int64_t, int64_t, double, const double*, int64_t,
                          const double*, int64_t, double, double*, int64_t);
typedef void (*cgemm64_t)(int, int, int, int64_t, int64_t, int64_t, const void*, const void*, int64_t,
                          const void*, int64_t, const void*, void*, int64_t);
typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                        float, float*, int);
typedef void (*dgemm_t)(int, int, int, int, int, int, double, const double*, int, const double*, int,
                        double, double*, int);
typedef void (*cgemm_t)(int, int, int, int, int, int, const void*, const void*, int, const void*, int,
                        const void*, void*, int);
typedef void (*set_threads_t)(int);

static sgemm64_t sgemm64;
static dgemm64_t dgemm64;
static cgemm64_t cgemm64;
static set_threads_t set_threads;

/* Returns 0 when every symbol was found in the library at `path` (then calls go there). */
int mlxkv_blas_bind(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) return 1;
  sgemm64_t s = (sgemm64_t)dlsym(lib, "scipy_cblas_sgemm64_");
  dgemm64_t d = (dgemm64_t)dlsym(lib, "scipy_cblas_dgemm64_");
  cgemm64_t c = (cgemm64_t)dlsym(lib, "scipy_cblas_cgemm64_");
  set_threads_t t = (set_threads_t)dlsym(lib, "scipy_openblas_set_num_threads64_");
  if (!s || !d || !c || !t) return 2;
  sgemm64 = s;
  dgemm64 = d;
  cgemm64 = c;
  set_threads = t;
  return 0;
}

int mlxkv_blas_set_threads(int n) {
  if (!set_threads) return 1;
  set_threads(n);
  return 0;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  if (sgemm64) {
    sgemm64(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    ((sgemm_t)dlsym(RTLD_NEXT, "cblas_sgemm"))(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  if (dgemm64) {
    dgemm64(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    ((dgemm_t)dlsym(RTLD_NEXT, "cblas_dgemm"))(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int lda,
                 const void* b, int ldb, const void* beta, void* c, int ldc) {
  if (cgemm64) {
    cgemm64(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    ((cgemm_t)dlsym(RTLD_NEXT, "cblas_cgemm"))(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// Hands the kernels' thread pool to the BLAS shim (csrc/blas_shim.cpp), so MLX's float32 matmuls
// (attention where the native kernel does not serve it) use both cores instead of MLX's one
// thread. The shim is a separate library, loaded before mlx; it exports the hook if present.
#include <dlfcn.h>

#include "blas_hook.h"
#include "qmm.h"

namespace mlxkv {

namespace {

void run_on_pool(int64_t count, MlxkvChunkTask task, void* ctx) {
  pool_run([count](int) { return count; }, [task, ctx](int64_t chunk, int) { task(ctx, chunk); });
}

}  // namespace

void hand_pool_to_blas_shim() {
  using UseRunner = void (*)(MlxkvRunner);
  if (auto use = reinterpret_cast<UseRunner>(dlsym(RTLD_DEFAULT, "mlxkv_blas_use_runner"))) use(&run_on_pool);
}

}  // namespace mlxkv

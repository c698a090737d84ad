// The hook between the BLAS shim (its own library, loaded before mlx) and the native kernels'
// extension: the extension hands the shim a runner for its thread pool (`mlxkv_blas_use_runner`).
#pragma once

#include <cstdint>

// Runs task(ctx, chunk) for chunks 0..count-1 and returns when all are done.
using MlxkvChunkTask = void (*)(void* ctx, int64_t chunk);
using MlxkvRunner = void (*)(int64_t count, MlxkvChunkTask task, void* ctx);

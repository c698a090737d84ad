"""The native quantized matmul, attention, decoder layer, SwiGLU, GeGLU, RMS norm, LoRA delta, log-softmax and sampler (imports mlx; load the BLAS shim first if you want it)."""

import mlx.core  # noqa: F401  (registers mx.array with nanobind before _ext loads)

from mlxkv_cpu_kernels._ext import (
    attend,
    best_isa,
    decoder_layer,
    geglu,
    isa,
    log_softmax,
    low_rank,
    num_threads,
    quantized_matmul,
    quantized_matmuls,
    rms_norm,
    sample,
    set_isa,
    set_num_threads,
    swiglu,
)

__all__ = ["attend", "best_isa", "decoder_layer", "geglu", "isa", "log_softmax", "low_rank", "num_threads", "quantized_matmul", "quantized_matmuls", "rms_norm", "sample", "set_isa", "set_num_threads", "swiglu"]

"""Puts a model on the native CPU path: which kernels it takes, and what the fingerprint records."""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.nn as nn

from mlxkv_inference.native.attention import NATIVE_ATTENTION, use_native_attention
from mlxkv_inference.native.kernels import (FLOAT32_ACTIVATIONS, WIDENED_TO_8_BITS, CpuKernels, float32_activations,
                                            use_float32_parameters, use_native_kernels, widen_to_8_bits)
from mlxkv_inference.native.layer import use_native_layers
from mlxkv_inference.native.mlp import NATIVE_GEGLU, NATIVE_SWIGLU, use_native_geglu, use_native_swiglu
from mlxkv_inference.native.norm import NATIVE_GEMMA_RMS_NORM, NATIVE_RMS_NORM, use_native_gemma_rms_norm, use_native_rms_norm

# What the config fingerprint records for the native path's sampling log-softmax: it shapes no KV,
# but the tokens a resumed checkpoint continues with (sampling reads the log-probabilities).
NATIVE_LOG_SOFTMAX = "log_softmax native/1"
NATIVE_SAMPLER = "sampler native/1"  # seeded draws take other tokens than MLX's categorical: checkpoints must not mix them


class NativePath(NamedTuple):
    """What `install` gave the model: whether attention runs the native kernel, and the native ops
    that change numbers (they go into the config fingerprint, so KV never crosses paths)."""

    attention: bool
    ops: tuple[str, ...]


def install(model: nn.Module, config: dict[str, Any], cpu_kernels: CpuKernels) -> NativePath:
    """Swap the model's modules for the native kernels where they compute what the modules do
    (nothing with `cpu_kernels="mlx"`)."""
    if cpu_kernels != "native":
        return NativePath(False, ())
    widened = use_float32_parameters(model)
    widened_bits = widen_to_8_bits(model) > 0
    use_native_kernels(model)
    attention = use_native_attention(model, config)
    swiglu = attention and use_native_swiglu(model)  # float32 activations checked
    rms_norm = attention and use_native_rms_norm(model)
    if rms_norm and swiglu:
        use_native_layers(model)  # the same bits in one node a layer: nothing to fingerprint
    # Gemma 3 keeps mlx-lm's attention (sliding-window rings), so its kernels ask for float32
    # activations themselves rather than through native attention.
    float32 = float32_activations(model)
    geglu = float32 and use_native_geglu(model)
    gemma_rms_norm = float32 and use_native_gemma_rms_norm(model)
    used = ((FLOAT32_ACTIVATIONS, widened), (WIDENED_TO_8_BITS, widened_bits), (NATIVE_ATTENTION, attention),
            (NATIVE_SWIGLU, swiglu), (NATIVE_RMS_NORM, rms_norm), (NATIVE_GEGLU, geglu),
            (NATIVE_GEMMA_RMS_NORM, gemma_rms_norm), (NATIVE_LOG_SOFTMAX, True), (NATIVE_SAMPLER, True))
    return NativePath(attention, tuple(op for op, on in used if on))


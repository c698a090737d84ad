"""RMS normalization through mlxkv-cpu-kernels' kernel, on the native path.

MLX's CPU backend has no kernel of its own for `mx.fast.rms_norm`: it runs the op's fallback
graph (square, sum, rsqrt, three multiplies, an add and their broadcasts), each primitive a
dispatch of its own, two norms a layer: at a small model's decode step most primitives are the
norms'. `use_native_rms_norm` gives the model's `nn.RMSNorm` modules the one-op kernel. A row's
bits depend on that row alone (its sum of squares runs in a fixed order, csrc/activations.h),
not MLX's, so the config fingerprint records it (`NATIVE_RMS_NORM`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference.mixins import mix_into

__all__ = ["NATIVE_RMS_NORM", "NativeRmsNormMixin", "use_native_rms_norm"]

NATIVE_RMS_NORM = "rms_norm native/1"  # what the config fingerprint records (see binding.config_fingerprint)

_RMS_NORMS = (("mlx.nn.layers.normalization", "RMSNorm"),)


class NativeRmsNormMixin:
    """Mixed into `nn.RMSNorm`: the same normalization through the native kernel (float32 input
    and weight; anything else keeps MLX's op)."""

    def __call__(self, x: mx.array) -> mx.array:
        from mlxkv_cpu_kernels import ops

        norm: Any = self
        weight = norm["weight"]
        if x.dtype != mx.float32 or weight.dtype != mx.float32:
            out: mx.array = super().__call__(x)  # type: ignore[misc]
            return out
        native: mx.array = ops.rms_norm(x, weight, norm.eps)
        return native


def use_native_rms_norm(model: nn.Module) -> bool:
    """Gives every `nn.RMSNorm` of `model` with float32 weights the native kernel (call it only
    where activations are float32); returns whether any module got it."""
    return mix_into(model, _RMS_NORMS, NativeRmsNormMixin, "Native", where=lambda norm: norm.weight.dtype == mx.float32)

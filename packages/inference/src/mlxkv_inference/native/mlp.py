"""SwiGLU through mlxkv-cpu-kernels' elementwise kernel, on the native path.

mlx-lm's llama-family MLP computes down(silu(gate(x)) * up(x)) with a shapeless `mx.compile`d
`swiglu`, which MLX's CPU backend runs as a scalar loop calling libm's fma (a visible share of a
batched decode step in a profile). `use_native_swiglu` gives those MLP classes the native kernel
(vectorized, on the kernels' thread pool). It is elementwise, so a row's bits do not depend on
its neighbours; its exp is not MLX's, so the config fingerprint records it (`NATIVE_SWIGLU`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference.native.kernels import project
from mlxkv_inference.mixins import mix_into

__all__ = ["NATIVE_SWIGLU", "use_native_swiglu"]

NATIVE_SWIGLU = "swiglu native/1"  # what the config fingerprint records (see binding.config_fingerprint)

# mlx-lm MLP classes whose forward is exactly `down_proj(swiglu(gate_proj(x), up_proj(x)))`.
_SWIGLU_MLPS = (("mlx_lm.models.llama", "MLP"), ("mlx_lm.models.qwen2", "MLP"), ("mlx_lm.models.qwen3", "MLP"))


class NativeSwigluMixin:
    """Mixed into an mlx-lm MLP class: the same forward with the native SwiGLU."""

    def __call__(self, x: mx.array) -> mx.array:
        from mlxkv_cpu_kernels import ops

        mlp: Any = self
        gate, up = project(x, [mlp.gate_proj, mlp.up_proj])
        out: mx.array = mlp.down_proj(ops.swiglu(gate, up))
        return out


def use_native_swiglu(model: nn.Module) -> bool:
    """Gives every MLP of `model` whose class is a known mlx-lm SwiGLU MLP the native kernel
    (call it only where activations are float32: the kernel takes nothing else); returns whether
    any MLP got it."""
    return mix_into(model, _SWIGLU_MLPS, NativeSwigluMixin, "NativeSwiglu")

"""SwiGLU and GeGLU through mlxkv-cpu-kernels' elementwise kernels, on the native path.

mlx-lm's llama-family MLP computes down(silu(gate(x)) * up(x)) with a shapeless `mx.compile`d
`swiglu`, which MLX's CPU backend runs as a scalar loop calling libm's fma (a visible share of a
batched decode step in a profile). `use_native_swiglu` gives those MLP classes the native kernel
(vectorized, on the kernels' thread pool). Gemma 3's MLP computes down(gelu_approx(gate(x)) * up(x)),
whose tanh MLX runs as a scalar loop too (most of a 9-row speculative round's MLP time on Gemma 3
270M); `use_native_geglu` gives it the native GeGLU. Both are elementwise, so a row's bits do not
depend on its neighbours; their exp is not MLX's, so the config fingerprint records each
(`NATIVE_SWIGLU`, `NATIVE_GEGLU`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference.native.kernels import project
from mlxkv_inference.mixins import mix_into

__all__ = ["NATIVE_GEGLU", "NATIVE_SWIGLU", "NativeGegluMixin", "NativeSwigluMixin", "use_native_geglu", "use_native_swiglu"]

NATIVE_SWIGLU = "swiglu native/1"  # what the config fingerprint records (see binding.config_fingerprint)
NATIVE_GEGLU = "geglu native/1"

# mlx-lm MLP classes whose forward is exactly `down_proj(swiglu(gate_proj(x), up_proj(x)))`.
_SWIGLU_MLPS = (("mlx_lm.models.llama", "MLP"), ("mlx_lm.models.qwen2", "MLP"), ("mlx_lm.models.qwen3", "MLP"))
# mlx-lm MLP classes whose forward is exactly `down_proj(nn.gelu_approx(gate_proj(x)) * up_proj(x))`.
_GEGLU_MLPS = (("mlx_lm.models.gemma3_text", "MLP"),)


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


class NativeGegluMixin:
    """Mixed into an mlx-lm GeGLU MLP class: the same forward with the native GeGLU (float32
    gate and up; anything else keeps MLX's gelu_approx)."""

    def __call__(self, x: mx.array) -> mx.array:
        from mlxkv_cpu_kernels import ops

        mlp: Any = self
        gate, up = project(x, [mlp.gate_proj, mlp.up_proj])
        if gate.dtype != mx.float32 or up.dtype != mx.float32:
            hidden = nn.gelu_approx(gate) * up
        else:
            hidden = ops.geglu(gate, up)
        out: mx.array = mlp.down_proj(hidden)
        return out


def use_native_geglu(model: nn.Module) -> bool:
    """Gives every MLP of `model` whose class is a known mlx-lm GeGLU MLP the native kernel (call
    it only where activations are float32: other dtypes fall back to MLX per call, but the
    fingerprint records the kernel); returns whether any MLP got it."""
    return mix_into(model, _GEGLU_MLPS, NativeGegluMixin, "NativeGeglu")

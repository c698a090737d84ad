"""RMS normalization through mlxkv-cpu-kernels' kernel, on the native path.

MLX's CPU backend has no kernel of its own for `mx.fast.rms_norm`: it runs the op's fallback
graph (square, sum, rsqrt, three multiplies, an add and their broadcasts), each primitive a
dispatch of its own, two norms a layer: at a small model's decode step most primitives are the
norms'. `use_native_rms_norm` gives the model's `nn.RMSNorm` modules the one-op kernel. A row's
bits depend on that row alone (its sum of squares runs in a fixed order, csrc/activations.h),
not MLX's, so the config fingerprint records it (`NATIVE_RMS_NORM`). Gemma 3's own RMSNorm
(`mx.fast.rms_norm(x, 1 + weight, eps)`, four a block plus the q/k norms) gets the same kernel
with `1 + weight` computed once at install (`use_native_gemma_rms_norm`, `NATIVE_GEMMA_RMS_NORM`).
Against `mx.fast.rms_norm` either stays within rtol 1e-5, atol 1e-6 (measured: 8.3e-7 relative, 13 ulp).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference.mixins import mix_into

__all__ = ["NATIVE_GEMMA_RMS_NORM", "NATIVE_RMS_NORM", "NativeGemmaRmsNormMixin", "NativeRmsNormMixin", "use_native_gemma_rms_norm",
           "use_native_rms_norm"]

NATIVE_RMS_NORM = "rms_norm native/1"  # what the config fingerprint records (see binding.config_fingerprint)
NATIVE_GEMMA_RMS_NORM = "gemma rms_norm native/1"

_RMS_NORMS = (("mlx.nn.layers.normalization", "RMSNorm"),)
# mlx-lm norm classes whose forward is exactly `mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)`.
_GEMMA_RMS_NORMS = (("mlx_lm.models.gemma3_text", "RMSNorm"),)


class _NativeNorm:
    """The kernel call both mixins make: float32 input and weight only (anything else keeps MLX's
    op), with the weight `_kernel_weight` gives."""

    def __call__(self, x: mx.array) -> mx.array:
        from mlxkv_cpu_kernels import ops

        norm: Any = self
        weight = norm["weight"]
        if x.dtype != mx.float32 or weight.dtype != mx.float32:
            out: mx.array = super().__call__(x)  # type: ignore[misc]
            return out
        native: mx.array = ops.rms_norm(x, self._kernel_weight(weight), norm.eps)
        return native

    def _kernel_weight(self, weight: mx.array) -> mx.array:
        return weight


class NativeRmsNormMixin(_NativeNorm):
    """Mixed into `nn.RMSNorm`: the same normalization through the native kernel."""


def use_native_rms_norm(model: nn.Module) -> bool:
    """Gives every `nn.RMSNorm` of `model` with float32 weights the native kernel (call it only
    where activations are float32); returns whether any module got it."""
    return mix_into(model, _RMS_NORMS, NativeRmsNormMixin, "Native", where=lambda norm: norm.weight.dtype == mx.float32)


class NativeGemmaRmsNormMixin(_NativeNorm):
    """Mixed into Gemma's RMSNorm: the same normalization through the native kernel with the
    weight `1 + weight` computed once (the bits MLX's `1.0 + weight` gives each call)."""

    def _kernel_weight(self, weight: mx.array) -> mx.array:
        source, plus_one = self.__dict__.get("_plus_one", (None, None))
        if source is not weight or plus_one is None:  # weights replaced since install: add the one in the graph
            return 1.0 + weight
        kept: mx.array = plus_one
        return kept


def use_native_gemma_rms_norm(model: nn.Module) -> bool:
    """Gives every Gemma RMSNorm of `model` with float32 weights the native kernel, with its
    `1 + weight` evaluated now (a lazy one would be recomputed by every compiled step); call it
    only where activations are float32. Returns whether any module got it."""
    if not mix_into(model, _GEMMA_RMS_NORMS, NativeGemmaRmsNormMixin, "NativeGemma",
                    where=lambda norm: norm.weight.dtype == mx.float32):
        return False
    modules: list[tuple[str, Any]] = model.named_modules()  # type: ignore[no-untyped-call]  # mlx leaves it untyped
    norms: list[Any] = [module for _, module in modules if isinstance(module, NativeGemmaRmsNormMixin)]
    for norm in norms:
        # NOTE: kept outside the module's dict: not a parameter (saved, loaded or digested).
        object.__setattr__(norm, "_plus_one", (norm.weight, 1.0 + norm.weight))
    mx.eval([norm.__dict__["_plus_one"][1] for norm in norms])
    return True

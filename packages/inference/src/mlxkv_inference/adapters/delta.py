"""The low-rank delta of an adapted linear layer, per row of a step.

mlx-lm's math, operation for operation (tuner/lora.py `LoRALinear`, tuner/dora.py `DoRALinear`):

    LoRA:  out = y + (scale * ((x @ lora_a) @ lora_b))           y = the base layer's product
    DoRA:  out = (m / |W + scale * lora_b^T lora_a^T|_rows) * (x @ W^T + scale * (x @ lora_a) @ lora_b)  (+ bias)

In a batched step the base product runs once for all rows; the rows of each adapter stack are
gathered, get their delta (dense float32 products: row-invariant with the fixed-order BLAS shim,
so a row gets the bits it gets alone), and are put back in place; other rows keep `y` untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference.adapters.files import Adapter, LowRank


@dataclass(frozen=True, slots=True, eq=False)
class RowGroup:
    """Rows of a step (indices into its (R, 1, D) rows; None: every position of a lone
    sequence's (1, L, D) input) and the adapters they run under, in order."""

    rows: mx.array | None
    adapters: tuple[Adapter, ...]


@dataclass(frozen=True, slots=True, eq=False)
class RowPlan:
    """A step's adapted rows: the groups, and where each output row comes from in the base
    product's rows followed by the groups' rows (None: a lone sequence, one group)."""

    groups: tuple[RowGroup, ...]
    order: mx.array | None = None


class AdaptedLinear(nn.Module):
    """Stands in for `base` (a Linear or QuantizedLinear) while a step with adapted rows is built."""

    base: Any
    path: str
    plan: RowPlan
    denominators: dict[str, mx.array]

    def __init__(self, base: nn.Module, path: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx leaves it untyped
        # Plain attributes beside the module tree (Module.__setattr__ would adopt `base` as a child).
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "plan", RowPlan(()))
        object.__setattr__(self, "denominators", {})

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = self.base(x)
        plan: RowPlan = self.plan
        if plan.order is None:
            return self._adapt(x, y, plan.groups[0].adapters) if plan.groups else y
        pieces = [y]
        for group in plan.groups:
            assert group.rows is not None
            pieces.append(self._adapt(x[group.rows], y[group.rows], group.adapters))
        return mx.concatenate(pieces)[plan.order]

    def _adapt(self, x: mx.array, y: mx.array, adapters: Sequence[Adapter]) -> mx.array:
        out = y
        for adapter in adapters:
            low = adapter.layers.get(self.path)
            if low is None:
                continue
            if low.magnitude is not None:
                out = self._dora(x, adapter, low)
            else:
                z = (x @ low.lora_a) @ low.lora_b
                out = out + (adapter.scale * z).astype(x.dtype)
        return out

    def _dora(self, x: mx.array, adapter: Adapter, low: LowRank) -> mx.array:
        assert low.magnitude is not None
        w = dense_weight(self.base)
        z = (x @ low.lora_a) @ low.lora_b
        out = x @ w.T + (adapter.scale * z).astype(x.dtype)
        out = (low.magnitude / self._denominator(adapter, low, w)).astype(x.dtype) * out
        base: Any = self.base
        return out + base.bias if "bias" in base else out

    def _denominator(self, adapter: Adapter, low: LowRank, w: mx.array) -> mx.array:
        """DoRA's row norms of the adapted weight (a constant: mlx-lm recomputes it each call)."""
        cached: dict[str, mx.array] = self.denominators
        if adapter.digest not in cached:
            adapted = w + (adapter.scale * low.lora_b.T) @ low.lora_a.T
            cached[adapter.digest] = mx.linalg.norm(adapted, axis=1)
        return cached[adapter.digest]


def dense_weight(linear: nn.Module) -> mx.array:
    """The layer's (out, in) weight, dequantized where it is quantized (as DoRA computes with it)."""
    module: Any = linear
    if isinstance(linear, nn.QuantizedLinear):
        weight: mx.array = mx.dequantize(module.weight, module.scales, module.get("biases"), group_size=module.group_size,
                                         bits=module.bits, mode=getattr(module, "mode", "affine"))
        return weight
    dense: mx.array = module.weight
    return dense


def linear_dims(linear: nn.Module) -> tuple[int, int] | None:
    """(input, output) features of a Linear or QuantizedLinear; None for any other module."""
    module: Any = linear
    if isinstance(linear, nn.QuantizedLinear):
        return int(module.weight.shape[1] * 32 // module.bits), int(module.weight.shape[0])
    if isinstance(linear, nn.Linear):
        return int(module.weight.shape[1]), int(module.weight.shape[0])
    return None

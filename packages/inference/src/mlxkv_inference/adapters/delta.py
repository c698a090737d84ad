"""The low-rank delta of an adapted linear layer, per row of a step.

mlx-lm's math, operation for operation (tuner/lora.py `LoRALinear`, tuner/dora.py `DoRALinear`):

    LoRA:  out = y + (scale * ((x @ lora_a) @ lora_b))           y = the base layer's product
    DoRA:  out = (m / |W + scale * lora_b^T lora_a^T|_rows) * (x @ W^T + scale * (x @ lora_a) @ lora_b)  (+ bias)

In a batched step the base product runs once for all rows; each adapter stack's delta is computed
over the step's rows (dense float32 products of rank r: row-invariant with the fixed-order BLAS
shim, so a row gets the bits it gets alone) and selected into that stack's rows only; other rows
keep `y` untouched. (Computing every stack over every row costs a few small products; gathering
each stack's rows and scattering them back cost more graph nodes, which dominate on MLX's CPU.)
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
    """Rows of a step (a (R, 1, 1) mask over its (R, 1, D) rows, and their indices; None: every
    position of a lone sequence's (1, L, D) input) and the adapters they run under, in order."""

    rows: mx.array | None
    adapters: tuple[Adapter, ...]
    indices: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True, eq=False)
class RowDelta:
    """One adapter's LoRA delta on some rows of one linear layer: rows += scale * ((x @ a) @ b),
    a given transposed (r, in)."""

    lora_a_t: mx.array
    lora_b: mx.array
    scale: float
    rows: list[int]


@dataclass(frozen=True, slots=True, eq=False)
class RowPlan:
    """A step's adapted rows, by adapter stack (one group with `rows` None: a lone sequence)."""

    groups: tuple[RowGroup, ...]


class AdaptedLinear(nn.Module):
    """Stands in for `base` (a Linear or QuantizedLinear) while a step with adapted rows is built."""

    base: Any
    path: str
    plan: RowPlan
    denominators: dict[str, mx.array]
    derived: tuple[RowPlan, int, list[RowDelta] | None] | None  # row_deltas of the plan it last saw

    def __init__(self, base: nn.Module, path: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx leaves it untyped
        # Plain attributes beside the module tree (Module.__setattr__ would adopt `base` as a child).
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "plan", RowPlan(()))
        object.__setattr__(self, "denominators", {})
        object.__setattr__(self, "derived", None)

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = self.base(x)
        out = y
        for group in self.plan.groups:
            if not any(self.path in adapter.layers for adapter in group.adapters):
                continue
            adapted = self._adapt(x, y, group.adapters)
            out = adapted if group.rows is None else mx.where(group.rows, adapted, out)
        return out

    def row_deltas(self, rows: int) -> list[RowDelta] | None:
        """This step's LoRA deltas on this layer, over its `rows` rows, in the order each row adds
        them; None where a DoRA adapter is among them (its rescaling is not a delta)."""
        derived = self.derived
        if derived is not None and derived[0] is self.plan and derived[1] == rows:
            return derived[2]
        deltas = self._row_deltas(rows)
        object.__setattr__(self, "derived", (self.plan, rows, deltas))
        return deltas

    def _row_deltas(self, rows: int) -> list[RowDelta] | None:
        deltas = []
        for group in self.plan.groups:
            indices = list(range(rows)) if group.indices is None else list(group.indices)
            for adapter in group.adapters:
                low = adapter.layers.get(self.path)
                if low is None:
                    continue
                if low.magnitude is not None:
                    return None
                a_t = low.lora_a_t if low.lora_a_t is not None else low.lora_a.T
                deltas.append(RowDelta(a_t, low.lora_b, adapter.scale, indices))
        return deltas

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

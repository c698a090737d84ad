"""`AdapterBank`: the adapters checked against one model, and the steps that run under them.

A sequence's caches carry the adapters its KV is computed under (`AdaptedCaches`): the loop, the
scheduler and speculation pass them along untouched, so every forward over them (a prefill chunk,
a decode step, a round's positions, a batched step) knows which rows to adapt without any of them
knowing about adapters. While such a forward is built, the adapted linears of the model are
swapped for `AdaptedLinear`s carrying the step's rows, and swapped back after: a step without
adapted rows runs the model exactly as before (fused layers, compiled steps).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference.adapters.delta import AdaptedLinear, RowGroup, RowPlan, linear_dims
from mlxkv_inference.adapters.files import Adapter, AdapterStack, LowRank
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.errors import AdapterMismatchError


class AdaptedCaches(list[LayerCache]):
    """A sequence's per-layer caches, computed under `stack` (checked by `bank`)."""

    def __init__(self, caches: Sequence[LayerCache], stack: AdapterStack, bank: AdapterBank) -> None:
        super().__init__(caches)
        self.stack = stack
        self.bank = bank


def namespace_of(caches: Sequence[LayerCache]) -> str:
    """The cache namespace of KV computed in `caches` ("" for the base model's)."""
    return caches.stack.ns if isinstance(caches, AdaptedCaches) else ""


class AdapterBank:
    """Checks adapters against `model` (named `model_id` in errors) and applies them per row."""

    def __init__(self, model: nn.Module, model_id: str) -> None:
        self._model = model
        self._model_id = model_id
        self._wrappers: dict[str, AdaptedLinear] = {}
        self._named: dict[str, Any] | None = None  # the model's modules by path, read once (no swap in place)
        self._exact_rows: dict[tuple[int, int, int], int] = {}  # (in, rank, out) -> rows probed row-invariant (-1: not)
        # Per step these would cost ~1 ms of Python over a batch of adapted rows: kept by namespace
        # (the same digests are the same files), the plan for the last batch (the same for many steps).
        self._shapes: dict[str, frozenset[tuple[int, int, int]]] = {}
        self._paths: dict[str, tuple[str, ...]] = {}
        self._sites: dict[str, tuple[Any, str]] = {}  # module path -> (parent module, leaf name)
        self._last_plan: tuple[tuple[AdapterStack | None, ...], tuple[int, ...], RowPlan] | None = None

    def check(self, adapter: Adapter) -> None:
        """Raises `AdapterMismatchError` (naming the adapter's base and this model) where a module
        it adapts is missing here, is not a linear layer, or has other dimensions."""
        modules = self._modules()
        for path, low in sorted(adapter.layers.items()):
            module = modules.get(path)
            problem = _misfit(linear_dims(module) if module is not None else None, low)
            if problem is not None:
                raise AdapterMismatchError(
                    f"adapter {adapter.path} (trained on {adapter.base_model or 'an unnamed base model'}) does not fit "
                    f"model {self._model_id}: {path}: {problem}")

    def tag(self, caches: Sequence[LayerCache], stack: AdapterStack) -> list[LayerCache]:
        """`caches` marked as computed under `stack` (each adapter checked here first)."""
        for adapter in stack.adapters:
            self.check(adapter)
        return AdaptedCaches(caches, stack, self)

    def adapted(self, caches: Sequence[LayerCache]) -> bool:
        """Whether forwards over `caches` run under adapters of this bank."""
        return self._stack(caches) is not None

    def stack_of(self, caches: Sequence[LayerCache]) -> AdapterStack:
        """The adapters forwards over `caches` run under here (empty: the base model)."""
        return self._stack(caches) or AdapterStack()

    def restricted(self, stack: AdapterStack) -> AdapterStack | None:
        """`stack` cut to the modules this bank's model has (a layer-skip draft: the target's first
        layers), each adapter keeping its digest; None where a module it keeps does not fit."""
        modules = self._modules()
        kept = []
        for adapter in stack.adapters:
            layers = {path: low for path, low in adapter.layers.items() if path in modules}
            if layers:
                kept.append(adapter if len(layers) == len(adapter.layers) else replace(adapter, layers=layers))
        try:
            for adapter in kept:
                self.check(adapter)
        except AdapterMismatchError:
            return None
        return AdapterStack(tuple(kept))

    def rows_exact(self, sequences: Sequence[Sequence[LayerCache]], rows: int) -> bool:
        """Whether the adapters of `sequences` give each of up to `rows` rows of a step its bits
        alone: their dense products, probed once per shape (row-invariant with the fixed-order
        BLAS shim; a BLAS that picks kernels by M would not be, and the step then runs a graph per row)."""
        stacks = {stack.ns: stack for stack in (self._stack(c) for c in sequences) if stack is not None}
        shapes = set().union(*(self._shapes_of(stack) for stack in stacks.values()))
        for shape in shapes:
            probed = self._exact_rows.get(shape, 1)
            if 0 <= probed < rows:
                probed = max(rows, 2 * probed, 8)
                self._exact_rows[shape] = probed if _products_row_invariant(shape, probed) else -1
        return all(0 <= rows <= self._exact_rows.get(shape, rows) for shape in shapes)

    @contextmanager
    def applied(self, sequences: Sequence[Sequence[LayerCache]], lengths: Sequence[int]) -> Iterator[None]:
        """While the forward feeding `lengths[i]` positions into `sequences[i]` is built, the
        adapted linears compute each sequence's rows under its own adapters."""
        stacks = tuple(self._stack(caches) for caches in sequences)
        if all(s is None for s in stacks):
            yield
            return
        plan = self._plan(stacks, tuple(lengths))
        distinct = {s.ns: s for s in stacks if s is not None}
        paths = sorted(set().union(*(self._paths_of(s) for s in distinct.values())))
        swapped = [self._swap_in(path, plan) for path in paths]
        try:
            yield
        finally:
            for parent, leaf, wrapper in swapped:
                parent[leaf] = wrapper.base
                object.__setattr__(wrapper, "plan", RowPlan(()))

    def _stack(self, caches: Sequence[LayerCache]) -> AdapterStack | None:
        # Caches tagged by another bank (a draft model sharing the target's caches) run its base model.
        if isinstance(caches, AdaptedCaches) and caches.bank is self and caches.stack.adapters:
            return caches.stack
        return None

    def _plan(self, stacks: tuple[AdapterStack | None, ...], lengths: tuple[int, ...]) -> RowPlan:
        """The step's plan: the last one where the batch is the same (the adapted linears keep
        what they derive from a plan while it lasts)."""
        last = self._last_plan
        if last is not None and last[1] == lengths and len(last[0]) == len(stacks) \
                and all(a is b for a, b in zip(last[0], stacks)):
            return last[2]
        plan = _plan(stacks, lengths)
        self._last_plan = (stacks, lengths, plan)
        return plan

    def _shapes_of(self, stack: AdapterStack) -> frozenset[tuple[int, int, int]]:
        """(in, rank, out) of every low-rank pair of `stack`'s adapters."""
        if stack.ns not in self._shapes:
            self._shapes[stack.ns] = frozenset(
                (int(low.lora_a.shape[0]), int(low.lora_a.shape[1]), int(low.lora_b.shape[1]))
                for adapter in stack.adapters for low in adapter.layers.values())
        return self._shapes[stack.ns]

    def _paths_of(self, stack: AdapterStack) -> tuple[str, ...]:
        if stack.ns not in self._paths:
            self._paths[stack.ns] = tuple({path for adapter in stack.adapters for path in adapter.layers})
        return self._paths[stack.ns]

    def _swap_in(self, path: str, plan: RowPlan) -> tuple[Any, str, AdaptedLinear]:
        site = self._sites.get(path)
        if site is None:
            parent_path, _, leaf = path.rpartition(".")
            site = self._sites[path] = (self._modules()[parent_path], leaf)
        parent, leaf = site
        wrapper = self._wrappers.get(path)
        if wrapper is None or wrapper.base is not parent[leaf]:
            wrapper = self._wrappers[path] = AdaptedLinear(parent[leaf], path)
        object.__setattr__(wrapper, "plan", plan)
        parent[leaf] = wrapper
        return parent, leaf, wrapper

    def _modules(self) -> dict[str, Any]:
        if self._named is None:
            named: Any = self._model.named_modules()  # type: ignore[no-untyped-call]  # mlx leaves it untyped
            self._named = dict(named)
        return self._named


def _products_row_invariant(shape: tuple[int, int, int], rows: int) -> bool:
    """(x @ a) @ b for M = 1..`rows` rows: each row bitwise the row computed alone."""
    inputs, rank, outputs = shape
    keys = mx.random.split(mx.random.key(inputs * 31 + rank * 7 + outputs), 3)
    x = mx.random.normal((rows, 1, inputs), key=keys[0])
    a, b = mx.random.normal((inputs, rank), key=keys[1]), mx.random.normal((rank, outputs), key=keys[2])
    alone = mx.concatenate([(x[r : r + 1] @ a) @ b for r in range(rows)])
    return all(bool(mx.array_equal((x[:m] @ a) @ b, alone[:m]).item()) for m in range(2, rows + 1))


def _misfit(dims: tuple[int, int] | None, low: LowRank) -> str | None:
    """What keeps `low` from adapting a linear layer of (input, output) `dims`; None: it fits."""
    if dims is None:
        return "no such linear layer in the model"
    a, b = tuple(low.lora_a.shape), tuple(low.lora_b.shape)
    if a != (dims[0], a[1]) or b != (a[1], dims[1]):
        return f"lora_a {a} and lora_b {b} do not fit a layer of {dims[0]} inputs and {dims[1]} outputs"
    if low.magnitude is not None and tuple(low.magnitude.shape) != (dims[1],):
        return f"m {tuple(low.magnitude.shape)} does not fit a layer of {dims[1]} outputs"
    return None


def _plan(stacks: Sequence[AdapterStack | None], lengths: Sequence[int]) -> RowPlan:
    """Group a step's rows by adapter stack; a lone sequence's positions are one group."""
    if len(stacks) == 1:
        only = stacks[0]
        assert only is not None
        return RowPlan((RowGroup(None, only.adapters),))
    rows: dict[str, list[bool]] = {}
    by_ns: dict[str, AdapterStack] = {}
    total = sum(lengths)
    start = 0
    for stack, length in zip(stacks, lengths, strict=True):
        if stack is not None:
            mask = rows.setdefault(stack.ns, [False] * total)
            mask[start : start + length] = [True] * length
            by_ns[stack.ns] = stack
        start += length
    return RowPlan(tuple(RowGroup(mx.array(mask).reshape(-1, 1, 1), by_ns[ns].adapters,
                                  tuple(i for i, adapted in enumerate(mask) if adapted)) for ns, mask in rows.items()))

"""`MlxAutoregressiveBinding`: one loaded model and everything the loop needs from it."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference import _mlx_lm
from mlxkv_inference.adapters.bank import AdapterBank
from mlxkv_inference.cache.compiled import CompiledDecoder
from mlxkv_inference.cache.factory import LayerCache, make_caches, maybe_quantize
from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.cache.recurrent import RecurrentCache
from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_inference.kv_scheme import KvScheme
from mlxkv_inference.native import batched
from mlxkv_inference.native.graphs import can_batch
from mlxkv_inference.native.install import install
from mlxkv_inference.native.kernels import CpuKernels
from mlxkv_inference.cache.recurrent_replay import use_recurrent_replay
from mlxkv_inference import binding_probes as probes
from mlxkv_inference.batch_exactness import BatchExactness, exactness_fingerprint
from mlxkv_inference.step_costs import StepCosts
from mlxkv_inference.tokenizer.protocol import Tokenizer

DEFAULT_PREFILL_CHUNK = 512
PROBED_ROWS = 8  # batch sizes the first row-invariance probe covers
log = logging.getLogger(__name__)
RING_ORDER = "oldest first/1"  # how a full sliding-window ring is attended (see config_fingerprint)

Interrupt = Callable[[], bool]  # asked between layers: True stops evaluating (see `evaluate_layers`)


class Fed(NamedTuple):
    """What a prefill fed: how many tokens, how many of them (its last chunk) an interrupt left
    partly unevaluated (0: none), and the first layer whose cache is not evaluated yet
    (`evaluate_layers` goes on from there)."""

    tokens: int
    unevaluated: int = 0
    layer: int = 0


def evaluate_layers(caches: Sequence[LayerCache], interrupt: Interrupt | None = None, start: int = 0) -> int:
    """Evaluate the caches from layer `start` on, in order, asking `interrupt` after each but the
    last; returns the first layer left unevaluated (`len(caches)`: none, all are evaluated).
    Each call evaluates at least layer `start`, so calls that are always stopped still progress.

    A stopped forward is not lost or changed: the deeper caches still hold its lazy graph, which
    this (or anything that reads them) evaluates later to the same values. It lets a scheduler
    hand the CPU to a request that just arrived mid-way through a long prompt's chunk, instead
    of after it."""
    if interrupt is None:
        mx.eval([c.state for c in caches[start:]])  # the layers before `start` are evaluated
        return len(caches)
    for index in range(start, len(caches)):
        mx.eval(caches[index].state)
        if index < len(caches) - 1 and interrupt():
            return index + 1
    return len(caches)


class MlxAutoregressiveBinding:
    """Owns a model, its tokenizer and identity; runs the prefill and decode phases."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        model_id: str,
        config: dict[str, Any],
        kv_scheme: KvScheme = KvScheme(),
        weights_digest: str = "",
        cpu_kernels: CpuKernels = "mlx",
    ) -> None:
        native = install(model, config, cpu_kernels)
        # rounds over a full sliding-window ring are chunks (cache/ring_order.py); probed before use
        rings = any(isinstance(c, RotatingKVCache) for c in make_caches(model))
        self._full_rings: bool | None = None if rings else False
        self.model = model
        self.cpu_kernels: CpuKernels = cpu_kernels
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.config = config
        self.kv_scheme = kv_scheme
        self.weight_bytes = _mlx_lm.parameter_bytes(model)
        self.tokenizer_hash = tokenizer.content_hash()
        self.native_attention = native.attention
        self.native_ops = native.ops
        self.config_fingerprint = config_fingerprint(config, kv_scheme, weights_digest, cpu_kernels, self.native_ops, rings)
        self._compiled = CompiledDecoder(model)
        self._invariant_rows = 1  # batch sizes probed row-invariant so far (-1: a kernel is not)
        self._positions_exact: bool | None = None  # see `verifies_positions`
        self._replays = use_recurrent_replay(model)  # see `replays_recurrence` (probed with the positions)
        self._compiled_positions: bool | None = None  # see `compiles_positions` (probed on first use)
        self.step_costs = StepCosts()  # what a forward of L positions costs here (speculation)
        self.prefix_of: MlxAutoregressiveBinding | None = None  # a layer-skip draft's target (models/draft.py)
        self.adapters = AdapterBank(model, model_id)  # caches it tags run their rows under adapters
        self.batch_exactness: BatchExactness = "strict"  # see `use_batch_exactness`
        self._strict_fingerprint = self.config_fingerprint

    def log_softmax(self, logits: mx.array) -> mx.array:
        """Log-probabilities over the last axis: on the native path the native kernel (MLX's
        logsumexp runs a scalar exp on the CPU, several times slower), else MLX's."""
        if self.cpu_kernels == "native" and logits.dtype == mx.float32:
            from mlxkv_cpu_kernels import ops

            out: mx.array = ops.log_softmax(logits)
            return out
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    @property
    def native_sampler(self) -> bool:
        """Whether seeded sampling runs the native kernel (see `generation.sampling`)."""
        return self.cpu_kernels == "native"

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_token_ids

    @property
    def compiled_traces(self) -> int:
        """How many distinct compiled decode steps exist (one per cache-kind combination)."""
        return self._compiled.num_traces

    @property
    def compiled_step_traced(self) -> bool:
        """Whether the last `decode_compiled` traced its step (its time is not a step's)."""
        return self._compiled.traced

    def release_thread_resources(self) -> None:
        """Drop compiled decode steps and MLX's buffer cache, from the thread that ran them.

        NOTE: a compiled step traced on a worker thread holds that thread's MLX stream; destroyed
        later from the main thread at interpreter exit, it aborts the process ("terminate called
        without an active exception"). A worker thread calls this before it ends, once the work
        it left running is done (a pipelined step's, drawn for generations that then ended).
        """
        mx.synchronize()
        self._compiled.clear()
        gc.collect()
        mx.clear_cache()

    def make_cache(self) -> list[LayerCache]:
        """Fresh per-layer caches for one sequence (kinds from the model's layers)."""
        return make_caches(self.model)

    def prefill(
        self,
        tokens: Sequence[int],
        caches: list[LayerCache],
        chunk_size: int = DEFAULT_PREFILL_CHUNK,
        on_chunk: Callable[[int], None] | None = None,
        interrupt: Interrupt | None = None,
    ) -> Fed:
        """Feed `tokens` into `caches` in chunks, evaluating each chunk (no logits kept);
        `on_chunk(fed)` follows each chunk with the number of `tokens` fed so far. Feeds them
        all, unless `interrupt` (see `evaluate_layers`) stops the evaluation of a chunk: that
        chunk, left partly unevaluated, is then the last."""
        if chunk_size < 1:
            raise ValueError(f"prefill chunk size={chunk_size} must be >= 1")
        for start in range(0, len(tokens), chunk_size):
            layer = self.feed(tokens[start : start + chunk_size], caches, interrupt)
            fed = min(start + chunk_size, len(tokens))
            if layer < len(caches):
                return Fed(fed, fed - start, layer)
            mx.clear_cache()
            if on_chunk is not None:
                on_chunk(fed)
        return Fed(len(tokens))

    def feed(self, tokens: Sequence[int], caches: list[LayerCache], interrupt: Interrupt | None = None) -> int:
        """Feed `tokens` in one forward and evaluate it (no logits kept), keeping MLX's buffer
        cache for the next step (a prompt's chunks release it: see `prefill`), unless `interrupt`
        stops the evaluation; returns the first layer left unevaluated (see `evaluate_layers`)."""
        self.forward(mx.array(list(tokens))[None], caches)
        return evaluate_layers(caches, interrupt)

    def decode(self, tokens: mx.array, caches: list[LayerCache]) -> mx.array:
        """Feed 1-D `tokens` through the ordinary graph; (1, vocab) float32 logits of the last one."""
        logits = self.forward(tokens[None], caches)[:, -1, :]
        return logits if logits.dtype == mx.float32 else logits.astype(mx.float32)

    def decode_compiled(self, tokens: mx.array, caches: list[LayerCache]) -> mx.array | None:
        """(L, vocab) logits of the compiled step over the L 1-D `tokens`; None when the caches
        cannot run it (empty, or several positions where `compiles_positions` is False or a
        cache cannot take them: a quantized or recurrent one, a sliding window outside a round)."""
        if (tokens.size > 1 and not self.compiles_positions) or self.adapters.adapted(caches):
            return None  # the compiled traces are the base model's
        logits = self._compiled.step(tokens, caches)
        if logits is not None:
            maybe_quantize(caches, self.kv_scheme)
        return logits

    def decode_positions(self, tokens: mx.array, caches: list[LayerCache]) -> mx.array:
        """Feed 1-D `tokens` in one forward; (L, vocab) float32 logits of every position."""
        logits = self.forward(tokens[None], caches)[0]
        return logits if logits.dtype == mx.float32 else logits.astype(mx.float32)

    def verifies_positions(self) -> bool:
        """Whether one forward over L positions gives each position's logits bitwise as L single
        decode steps do (probed once on scratch caches; speculative rounds need it)."""
        if self._positions_exact is None:
            try:
                self._positions_exact = probes.positions_agree(self)
                if self._positions_exact:
                    probes.calibrate_step_costs(self)
            except Exception as e:  # noqa: BLE001 - a probe that cannot run proves nothing: stay safe
                log.warning("the multi-position probe failed (%s: %s): speculation stays off", type(e).__name__, e)
                self._positions_exact = False
            if not self._positions_exact:
                log.warning("a multi-token forward of this model differs from single steps: speculation stays off, "
                            "prompts prefill in whole chunks")
            elif self._full_rings is None:
                self._full_rings = probes.safely(probes.full_rings_agree, self)
                if not self._full_rings:
                    log.warning("a round over full sliding-window rings differs from single steps: rounds stop at the window")
            if self._positions_exact and self._replays and not probes.replay_agrees(self):
                log.warning("replaying kept positions through the recurrent layers alone differs from feeding them "
                            "through the model: rolled-back rounds feed the model again")
                self._replays = False
        return self._positions_exact

    @property
    def verifies_full_rings(self) -> bool:
        """Whether speculative rounds may run over full sliding-window rings (`round_fits`)."""
        return self.verifies_positions() and bool(self._full_rings)

    @property
    def compiles_positions(self) -> bool:
        """Whether a round's positions may run through the compiled step (plain and sliding-window
        caches), probed bitwise against single compiled steps on first use (`--no-compiled-decode` never
        traces it)."""
        if self._compiled_positions is None:
            self._compiled_positions = self._settle_compiled_rounds()
        return self._compiled_positions

    def warm_up(self, compiled: bool, rows: int = 0) -> None:
        """Run now the probes (and step timings) the first requests would otherwise wait for:
        the multi-position probe, with `compiled` the compiled rounds' one, and the row-invariance
        probe of batched steps up to `rows` rows (where the model batches)."""
        if self.verifies_positions() and compiled and self._compiled_positions is None:
            self._compiled_positions = self._settle_compiled_rounds()
        if rows > 1:
            self.can_decode_batch([self.make_cache()], rows)

    def _settle_compiled_rounds(self) -> bool:
        """Probe the compiled rounds; where they run (plain and sliding-window caches), time the step sizes through
        them, as the rounds will run."""
        exact = self.verifies_positions() and probes.compiled_positions_agree(self)
        if exact and all(isinstance(c, PlainKVCache | RotatingKVCache) for c in self.make_cache()):
            scratch = CompiledDecoder(self.model)
            probes.calibrate_step_costs(self, lambda tokens, caches: scratch.step(tokens, caches))
        elif not exact and self._positions_exact:
            log.warning("the compiled step over several positions differs from single compiled steps: "
                        "speculative rounds run uncompiled")
        return exact

    @property
    def replays_recurrence(self) -> bool:
        """Whether a round's recurrent layers feed kept positions again by themselves (see
        `cache/recurrent_replay.py`), probed bitwise against feeding them through the model."""
        return self.verifies_positions() and self._replays

    def use_batch_exactness(self, mode: BatchExactness) -> None:
        """Set before the first request and before any cache is keyed by `config_fingerprint`
        (relaxed KV has its own identity); see `batch_exactness.py`."""
        self.config_fingerprint = exactness_fingerprint(self._strict_fingerprint, mode)
        self.batch_exactness = mode

    def can_decode_batch(self, caches: Sequence[Sequence[LayerCache]], rows: int | None = None) -> bool:
        """Whether `decode_batch` runs these sequences (`rows` positions in all, default one
        each) exactly as each would run alone: the graph is one `native.batched` drives and every
        matmul kind of the model is row-invariant (probed once, for up to `rows` rows). Relaxed
        batch exactness skips the probe: the graph alone decides."""
        rows = len(caches) if rows is None else rows
        if not can_batch(self.model, self.config, caches):
            return False
        if self.batch_exactness == "relaxed":
            return True
        if self._invariant_rows < 0:
            return False
        if rows > self._invariant_rows:
            # Twice what was probed: a batch that outgrew it (speculative rounds add rows) stalls
            # every running sequence once more per doubling, not once a row; sizes probed stay probed.
            probed = max(rows, 2 * self._invariant_rows, PROBED_ROWS)
            self._invariant_rows = probed if batched.rows_invariant(self.model, probed, self._invariant_rows) else -1
            if self._invariant_rows < 0:
                log.warning("a matmul kernel of this model is not row-invariant: batched decode runs a graph per row")
        return rows <= self._invariant_rows and self.adapters.rows_exact(caches, rows)

    def decode_batch(self, tokens: mx.array, caches: Sequence[list[LayerCache]],
                     lengths: Sequence[int] | None = None, logits_of: Sequence[int] | None = None) -> mx.array:
        """float32 logits: sequence i feeds its next `lengths[i]` of `tokens` (default one) into
        `caches[i]`; the logits of its last `logits_of[i]` rows (default all) follow the rows of
        the sequences before it (see `can_decode_batch`)."""
        with self.adapters.applied(caches, lengths if lengths is not None else [1] * len(caches)):
            logits = batched.decode_batch(self.model, tokens, caches, lengths, logits_of)
        for row in caches:
            maybe_quantize(row, self.kv_scheme)
        return logits

    def forward(self, tokens: mx.array, caches: list[LayerCache]) -> mx.array:
        """(1, L) tokens through the model over `caches` (adapters applied): (1, L, vocab) logits."""
        with self.adapters.applied([caches], [tokens.shape[1]]):
            logits = _mlx_lm.forward(self.model, tokens, list(caches))
        for cache in caches:
            if isinstance(cache, RecurrentCache):
                cache.count_tokens(tokens.shape[1])
        maybe_quantize(caches, self.kv_scheme)
        return logits


def config_fingerprint(
    config: dict[str, Any], kv_scheme: KvScheme, weights_digest: str, cpu_kernels: CpuKernels = "mlx",
    native_ops: Sequence[str] = (), rings: bool = False,
) -> str:
    """Hash of everything that shapes the KV a model computes: graph config, KV scheme, MLX, weights,
    the matmul kernels and the layer ops they replace (`native_ops`, e.g. attention and SwiGLU: KV
    computed by different kernels differs in the last bits; the sampler too, whose draws a resumed
    checkpoint continues). `rings`: the model has sliding-window layers, whose full rings are
    attended oldest key first (cache/ring_order.py), not in mlx-lm's cell order as KV computed
    before was."""
    payload = {
        "config": config,
        "kv_scheme": asdict(kv_scheme),
        "mlx": _mlx_lm.mlx_version(),
        "weights": weights_digest,
    }
    if cpu_kernels != "mlx":  # the mlx path keeps the fingerprints it always had
        payload["cpu_kernels"] = cpu_kernels
    if native_ops:
        payload["native_ops"] = list(native_ops)
    if rings:
        payload["ring_order"] = RING_ORDER
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]

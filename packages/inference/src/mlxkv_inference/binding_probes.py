"""The probes a binding runs once before it lets speculative rounds, compiled rounds or recurrent
replay loose: each compares a shortcut with the plain path bitwise on scratch caches. Where they
hold, step costs are timed so the first rounds are sized from this machine rather than a guess."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from mlxkv_inference.cache.compiled import CompiledDecoder
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.recurrent import RecurrentCache
from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_inference.cache.rounds import Round, round_fits

if TYPE_CHECKING:
    from mlxkv_inference.binding import MlxAutoregressiveBinding

PROBED_POSITIONS = 9  # positions the multi-position probe verifies in one forward
CALIBRATION_CONTEXT = 64  # tokens in the caches the step-cost calibration runs over
log = logging.getLogger(__name__)


def calibrate_step_costs(binding: MlxAutoregressiveBinding, forward: Callable[[mx.array, list[LayerCache]], mx.array | None] | None = None) -> None:
    """Seed `step_costs` with forwards of a few sizes (through `forward`, default the graph),
    so the first speculative rounds are sized from this machine rather than a guess (decode
    steps refine them as they run)."""
    run = forward or (lambda tokens, caches: binding.forward(tokens[None], caches))
    caches = binding.make_cache()
    binding.forward(mx.arange(CALIBRATION_CONTEXT)[None], caches)
    mx.eval([c.state for c in caches])
    for rows in (1, 2, 3, 5, PROBED_POSITIONS):
        if round_fits(caches, rows, binding.kv_scheme) < rows:
            continue
        best = float("inf")
        for _ in range(2):
            trial = [c.clone() for c in caches]  # recurrent state cannot be trimmed back
            mx.eval([c.state for c in trial])
            started = time.perf_counter()
            logits = run(mx.arange(rows), trial)
            if logits is None:
                return
            mx.eval(logits)
            best = min(best, time.perf_counter() - started)  # the first of a compiled size also traces
        binding.step_costs.replace(rows, best)


def _probe_round(binding: MlxAutoregressiveBinding, seed: int) -> tuple[list[LayerCache], list[int]]:
    """Scratch caches holding 3 random tokens, and the random tokens a round may feed next
    there (at most `PROBED_POSITIONS`, as `round_fits` allows): what the probes compare."""
    caches = binding.make_cache()
    tokens = [int(t) for t in mx.random.randint(0, binding.tokenizer.vocab_size, (3 + PROBED_POSITIONS,), key=mx.random.key(seed))]
    binding.forward(mx.array(tokens[:3])[None], caches)
    mx.eval([c.state for c in caches])
    return caches, tokens[3 : 3 + round_fits(caches, PROBED_POSITIONS, binding.kv_scheme)]


def positions_agree(binding: MlxAutoregressiveBinding) -> bool:
    """Whether one forward over a round's positions gives each position's logits bitwise as
    single steps do, on scratch caches."""
    caches, fed = _probe_round(binding, 7)
    if len(fed) < 2:
        return True  # no round could verify more than one position here (round_fits limits every round)
    alone = [c.clone() for c in caches]
    single = [binding.forward(mx.array([[t]]), alone)[0, -1] for t in fed]
    together = binding.forward(mx.array(fed)[None], caches)[0]
    return all(bool(mx.array_equal(together[i], single[i]).item()) for i in range(len(fed)))


def compiled_positions_agree(binding: MlxAutoregressiveBinding) -> bool:
    """Feed positions through the compiled step at once and one by one on scratch caches;
    whether every position's logits are bitwise equal (true where the caches are not all
    plain: the compiled step then never takes several positions)."""
    caches, fed = _probe_round(binding, 9)
    alone = [c.clone() for c in caches]
    scratch = CompiledDecoder(binding.model)  # its traces go with it: `--no-compiled-decode` keeps none
    try:
        together = scratch.step(mx.array(fed), caches)
        if together is None:
            return True
        singles = [scratch.step(mx.array([token]), alone) for token in fed]
    except Exception as e:  # noqa: BLE001 - a step that cannot trace is one rounds must not take
        log.info("the compiled step over several positions does not run here (%s: %s)", type(e).__name__, e)
        return False
    return all(single is not None and bool(mx.array_equal(together[i], single[0]).item()) for i, single in enumerate(singles))


def safely(probe: Callable[[MlxAutoregressiveBinding], bool], binding: MlxAutoregressiveBinding) -> bool:
    """`probe`'s answer; False where it cannot run (a probe that cannot run proves nothing)."""
    try:
        return probe(binding)
    except Exception as e:  # noqa: BLE001 - stay safe: the shortcut stays off
        log.warning("the %s probe failed (%s: %s)", probe.__name__, type(e).__name__, e)
        return False


def full_rings_agree(binding: MlxAutoregressiveBinding) -> bool:
    """Whether a round over full sliding-window rings (a chunk, `cache/ring_order.py`) gives each
    position's logits bitwise as single steps do, and keeps the rings as they write them, on
    scratch caches filled past the window (true where the model has no sliding window)."""
    caches = binding.make_cache()
    rings = [c for c in caches if isinstance(c, RotatingKVCache)]
    if not rings:
        return True
    window = max(c.max_size for c in rings)
    rows = min(PROBED_POSITIONS, min(c.max_size - c.keep for c in rings))
    tokens = [int(t) for t in mx.random.randint(0, binding.tokenizer.vocab_size, (window + 2 + rows,), key=mx.random.key(11))]
    binding.prefill(tokens[: window + 2], caches)
    fed = tokens[window + 2 :]
    alone = [c.clone() for c in caches]
    single = [binding.forward(mx.array([[t]]), alone)[0, -1] for t in fed]
    scratch = CompiledDecoder(binding.model)
    for compiled in (False, True):  # the graph, and the compiled step (where it takes the round)
        trial = [c.clone() for c in caches]
        kept = Round(trial, rows)
        together = scratch.step(mx.array(fed), trial) if compiled else binding.forward(mx.array(fed)[None], trial)[0]
        if together is None:
            kept.keep(1, fed, binding.feed)
            continue
        kept.keep(rows, fed, binding.feed)
        if not all(bool(mx.array_equal(together[i], single[i]).item()) for i in range(rows)):
            return False
        if not all(bool(mx.array_equal(x, y).item()) for a, b in zip(trial, alone)
                   if isinstance(a, RotatingKVCache) and isinstance(b, RotatingKVCache) for x, y in zip(a.window(), b.window())):
            return False
    return True


def replay_agrees(binding: MlxAutoregressiveBinding) -> bool:
    """Keep half of a round both ways on scratch caches; whether the states are bitwise equal."""
    if not any(isinstance(c, RecurrentCache) for c in binding.make_cache()):
        return True
    caches, fed = _probe_round(binding, 8)
    if len(fed) < 2:
        return True  # no round verifies more than one position here: nothing is ever rolled back
    states = []
    for replay in (True, False):
        trial = [c.clone() for c in caches]
        kept = Round(trial, len(fed), replay)
        binding.forward(mx.array(fed)[None], trial)
        kept.keep(len(fed) // 2, fed, binding.feed)
        states.append([c.state for c in trial if isinstance(c, RecurrentCache)])
    return all(a is b or (a is not None and b is not None and bool(mx.array_equal(a, b).item()))
               for mine, theirs in zip(*states) for a, b in zip(mine, theirs))

"""One decode step over the generations past their prefill: stacked rows through one batched
forward where the model's kernels allow it exactly, else a graph per row in the same step.

A generation speculating this step brings its drafts as more rows (its own draft length), and
what it accepts changes no other row; a prompt whose rest rides in the step (`Generation.join`)
brings its rest and last token, and only that last position gets the head.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx

from mlxkv_inference.binding import MlxAutoregressiveBinding
from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.scheduler.outcome import Outcomes, StepOutcome, failed

# The most rows a batched step may have, prompts riding in it (`join`) and drafts included: the
# row-invariance probe covers them at warm-up; a step past it would stall every row on a new probe.
STEP_MAX_ROWS = 64


class Decoded(NamedTuple):
    batched: bool  # the step ran stacked rows (else a graph per row, or nothing)
    fresh_seconds: float | None = None  # seconds a token of a new prompt's only chunk, where one rode in it


def decode(binding: MlxAutoregressiveBinding, ready: Sequence[Generation], outcomes: Outcomes) -> Decoded:
    """Step every generation in `ready` (a resumed one's pending token needs no step)."""
    stepping = [g for g in ready if g.needs_step]
    for generation in (g for g in ready if not g.needs_step):
        outcomes[id(generation)] = StepOutcome(generation, tuple(generation.accept(None)), False)
    shared = len(stepping) > 1 and binding.can_decode_batch([g.caches for g in stepping])
    joined = any(g.joining_rows for g in stepping)
    inputs = _inputs(stepping, shared, joined)
    rows = sum(int(t.size) for t in inputs)
    if (len(stepping) > 1 or joined) and binding.can_decode_batch([g.caches for g in stepping], rows):
        return _decode_batched(binding, stepping, inputs, outcomes)
    for generation, tokens in zip(stepping, inputs):
        try:
            deltas = generation.accept(generation.decode_alone(tokens))
        except Exception as e:  # noqa: BLE001 - one failed generation must not stop the others
            failed(outcomes, [generation], e)
        else:
            outcomes[id(generation)] = StepOutcome(generation, tuple(deltas), False)
    return Decoded(False)


def _inputs(stepping: Sequence[Generation], shared: bool, joined: bool) -> list[mx.array]:
    """Each generation's rows. A generation judges its drafts against the step's other rows:
    what the ones before it chose, the least of this one and of each after it (judged against
    one row a generation, every one drafts, and the step costs what none expected). A batched
    step keeps within the rows probed for it."""
    least = [g.joining_rows or 1 for g in stepping]  # a joined prompt's rows, else its pending token
    inputs: list[mx.array] = []
    rows = 0
    for i, generation in enumerate(stepping):
        others = rows + sum(least[i:]) if shared else 1
        most = max(STEP_MAX_ROWS - others, 0) if shared or joined else None
        inputs.append(generation.step_input(others, len(stepping) if shared else 1, most))
        rows += int(inputs[-1].size)
    return inputs


def _decode_batched(binding: MlxAutoregressiveBinding, stepping: Sequence[Generation], inputs: Sequence[mx.array],
                    outcomes: Outcomes) -> Decoded:
    started = time.perf_counter()
    lengths = [int(t.size) for t in inputs]
    wanted = [g.logit_rows for g in stepping]  # a joined prompt's last position, every other row
    try:
        logits = binding.decode_batch(mx.concatenate(list(inputs)), [g.caches for g in stepping], lengths, wanted)
        ends = list(itertools.accumulate(wanted))
        own = [logits[end - n : end] for n, end in zip(wanted, ends)]  # each generation's rows
        mx.eval([a for generation, rows in zip(stepping, own) for a in generation.draw(rows)])  # every plain row at once
        accepted = [generation.accept(rows) for generation, rows in zip(stepping, own)]
    except Exception as e:  # noqa: BLE001 - the rows shared the step: each of them failed
        failed(outcomes, list(stepping), e)
        return Decoded(False)
    seconds = time.perf_counter() - started
    fresh = None
    if wanted == lengths:
        binding.step_costs.record(sum(lengths), seconds)
    elif any(n < length and not g.cached_tokens for g, n, length in zip(stepping, wanted, lengths)):
        # A new prompt's only chunk was this step (a prompt fed in turns before does not join):
        # what the next new prompt's tokens are estimated at. No step cost: no head on its positions.
        fresh = seconds / sum(lengths)
    for generation, deltas in zip(stepping, accepted):
        outcomes[id(generation)] = StepOutcome(generation, tuple(deltas), False)
    return Decoded(True, fresh)

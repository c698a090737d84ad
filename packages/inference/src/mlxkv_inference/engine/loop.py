"""The autoregressive loop: chunked prefill, then pipelined decode.

    prompt  p0 p1 ... p(n-2) | p(n-1)          -> y0
            ^ prefill chunks   ^ first decode
    decode  y0 -> y1, y1 -> y2, ...  (step i+1 is queued with mx.async_eval before y(i) is read)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxkv_inference import _mlx_lm
from mlxkv_inference.binding import DEFAULT_PREFILL_CHUNK, MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import covered_tokens
from mlxkv_inference.engine.constraint import GrammarConstraint
from mlxkv_inference.engine.logits import LogitsProcessor
from mlxkv_inference.engine.sampling import Sampler

log = logging.getLogger(__name__)

# Called with (tokens prefilled, tokens to prefill): first (0, total), then after every chunk.
PrefillProgress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One generated token, its step index and the log-probabilities it was sampled from."""

    token: int
    step: int
    logprobs: mx.array


def generate_steps(
    binding: MlxAutoregressiveBinding,
    prompt: Sequence[int],
    caches: list[LayerCache],
    *,
    sampler: Sampler,
    max_tokens: int,
    processors: Sequence[LogitsProcessor] = (),
    context_window: int = 0,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    first_step: int = 0,
    on_prefill_done: Callable[[], None] | None = None,
    compiled_decode: bool = True,
    snapshot_at: Sequence[int] = (),
    on_snapshot: Callable[[int], None] | None = None,
    resume_pending: int | None = None,
    checkpoint_every: int = 0,
    on_checkpoint: Callable[[int, int, mx.array], None] | None = None,
    on_prefill_progress: PrefillProgress | None = None,
    constraint: GrammarConstraint | None = None,
) -> Iterator[TokenStep]:
    """Yield up to `max_tokens` tokens continuing `prompt` (which must not be empty).

    `caches` may already hold a prefix of `prompt`; only the uncached tail is fed. Step indices
    start at `first_step` (the sampler derives each step's key from it). After the consumer stops
    at token i, the caches cover `prompt` plus the tokens the loop fed (i included unless it was
    the last of `max_tokens`). Prefill pauses at each of `snapshot_at` (token counts) and calls
    `on_snapshot(n)` while the caches hold exactly the first n prompt tokens.

    Resuming (`resume_pending`): the caches already hold all of `prompt` and the token sampled
    next (but never fed) is given; it is yielded first, at step `first_step`, and nothing is
    prefilled. Every `checkpoint_every` tokens, `on_checkpoint(pending, emitted, logprobs)` is
    called while the caches hold `prompt` plus the `emitted` tokens yielded so far and `pending`
    has been sampled (from `logprobs`) but not fed: the state a resumed generation starts from.

    Prefill feeds the uncached prompt but its last token (the first decode step takes that one);
    `on_prefill_progress(done, total)` counts those tokens, from (0, total) on, once per chunk.

    `constraint` masks every step's logits to what its grammar allows; it consumes each token fed
    after the prompt. Its mask needs the previous token on the host, so a constrained step reads
    that token while its own forward pass already runs, and computes the mask meanwhile.
    """
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    if max_tokens < 1:
        return
    cached = covered_tokens(caches)
    if resume_pending is None and cached >= len(prompt):
        raise ValueError(f"caches already hold {cached} tokens; the prompt has only {len(prompt)}")
    if resume_pending is not None and cached != len(prompt):
        raise ValueError(f"resuming needs caches holding the whole prompt ({len(prompt)}), not {cached}")
    first_uncached, total = cached, len(prompt) - 1 - cached
    report = on_prefill_progress if resume_pending is None and total > 0 else None
    if report is not None:
        report(0, total)
    for point in sorted({p for p in snapshot_at if cached < p <= len(prompt) - 1}):
        binding.prefill(prompt[cached:point], caches, prefill_chunk, _chunk_reporter(report, cached - first_uncached, total))
        cached = point
        if on_snapshot is not None:
            on_snapshot(point)
    if resume_pending is None:
        binding.prefill(prompt[cached:-1], caches, prefill_chunk, _chunk_reporter(report, cached - first_uncached, total))
    window = context_window if processors else 0
    seen = list(prompt) if resume_pending is not None else list(prompt[:-1])
    history = mx.array(seen[-window:] if window else [], dtype=mx.int32)

    decode = _Decoder(binding, caches, compiled_decode)

    def step(tokens: mx.array, index: int) -> tuple[mx.array, mx.array]:
        nonlocal history
        logits = decode(tokens)
        if constraint is not None:
            _mlx_lm.async_eval(logits)  # the forward pass runs while the host computes the mask
            if index > first_step:  # `tokens` was generated (at step index - 1), not the prompt's end
                constraint.consume(_token(tokens))
            logits = constraint.apply(logits)
        if window:
            history = mx.concatenate([history, tokens.astype(mx.int32)])[-window:]
        for processor in processors:
            logits = processor(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs, index), logprobs.squeeze(0)

    if resume_pending is None:
        y, logprobs = step(mx.array([prompt[-1]]), first_step)
        _mlx_lm.async_eval(y, logprobs)
    else:  # its logprobs were not kept: the step that sampled it ran before the restart
        y, logprobs = mx.array([resume_pending], dtype=mx.uint32), mx.zeros((0,))
    for n in range(max_tokens):
        if n > 0 and checkpoint_every and on_checkpoint is not None and n % checkpoint_every == 0:
            on_checkpoint(_token(y), n, logprobs)
        if n + 1 < max_tokens:
            next_y, next_logprobs = step(y, first_step + n + 1)
            _mlx_lm.async_eval(next_y, next_logprobs)
        if n == 0 and on_prefill_done is not None:
            mx.eval(y)
            on_prefill_done()
        yield TokenStep(token=_token(y), step=first_step + n, logprobs=logprobs)
        if n % 256 == 255:
            mx.clear_cache()
        if n + 1 < max_tokens:
            y, logprobs = next_y, next_logprobs


class _Decoder:
    """One generation's decode: compiled single-token steps while they work, else the graph."""

    def __init__(self, binding: MlxAutoregressiveBinding, caches: list[LayerCache], compiled: bool) -> None:
        self._binding = binding
        self._caches = caches
        self.compiled = compiled

    def __call__(self, tokens: mx.array) -> mx.array:
        if self.compiled and tokens.size == 1:
            try:
                logits = self._binding.decode_compiled(tokens, self._caches)
            except Exception as e:  # noqa: BLE001 - any trace failure means: run this graph uncompiled
                log.warning("compiled decode disabled for this generation: %s: %s", type(e).__name__, e)
                self.compiled = False
            else:
                if logits is not None:
                    return logits
        return self._binding.decode(tokens, self._caches)


def _chunk_reporter(report: PrefillProgress | None, done_before: int, total: int) -> Callable[[int], None] | None:
    """A prefill segment's chunk callback, reporting progress over the whole prefill."""
    if report is None:
        return None
    return lambda fed: report(done_before + fed, total)


def _token(y: mx.array) -> int:
    value = y.item()
    assert isinstance(value, int)
    return value

"""The worker's side of a request's stream: text deltas (with their logprobs, the think section
and tool calls taken apart), the final `Finished` or `Failed`, and the status that goes with each."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.generation.results import TextDelta
from mlxkv_inference.tokenizer.protocol import Tokenizer
from mlxkv_serve import Delta, Failed, Finished, TokenLogprob

from mlxkv.engine.checkpoints import CheckpointWriter
from mlxkv.engine.jobs import Active, GenerationStatus, Job, StatusBook
from mlxkv.engine.logprobs import render

# NOTE: the engine's log: a failed generation is logged under the engine's name, which
# operators' logging settings (and a test) filter on.
log = logging.getLogger("mlxkv.engine.local_engine")


class Answers:
    def __init__(self, tokenizer: Tokenizer, statuses: StatusBook, generator: CachedGenerator,
                 checkpoints: CheckpointWriter | None) -> None:
        self._tokenizer = tokenizer
        self._statuses = statuses
        self._generator = generator
        self._checkpoints = checkpoints

    def push(self, entry: Active, deltas: Sequence[TextDelta], *, with_logprobs: bool) -> None:
        """Send `deltas` to the client: the answer's text and reasoning apart, with logprobs
        when asked for (`with_logprobs` False: their tokens were answered already)."""
        job = entry.job
        for delta in deltas:
            if entry.first is None:
                entry.first = time.perf_counter() - job.submitted  # queueing included, as a client sees it
            logprobs: tuple[TokenLogprob, ...] = ()
            if job.trail is not None and with_logprobs:
                logprobs = (render(self._tokenizer, *job.trail.next(delta.step)),)
            reasoning, text = entry.answer.feed(delta.text)
            if text or reasoning or logprobs:
                job.handle.push(Delta(text, reasoning, logprobs))

    def fail(self, job: Job, error: Exception) -> None:
        log.error("generation %s failed", job.handle.generation_id, exc_info=error)
        self._statuses.update(job, lambda s: s.fail(str(error)))
        job.handle.push(Failed(job.handle.generation_id, f"{type(error).__name__}: {error}"))

    def end_cancelled(self, job: Job) -> None:
        """A request cancelled before it started: its status and its stream's end."""
        self._statuses.update(job, GenerationStatus.cancel)
        job.handle.push(Finished("cancelled", None, len(job.prompt), 0, 0, 0, job.handle.generation_id, 0.0))

    def finish(self, entry: Active) -> None:
        job, generation, handle = entry.job, entry.generation, entry.job.handle
        self._generator.settle(generation)
        result = generation.result
        assert result is not None
        reasoning, rest, calls = entry.answer.finish()
        if rest or reasoning:
            handle.push(Delta(rest, reasoning))
        if self._checkpoints is not None and result.finish_reason != "cancelled":
            self._checkpoints.remove(job.key)  # finished: nothing left to resume
        # The caches of a resumed generation also hold the tokens generated before the restart:
        # usage counts those apart, so cached tokens never exceed the prompt.
        cached = min(result.cached_tokens, result.prompt_tokens)
        resumed = result.cached_tokens - cached
        self._statuses.update(job, lambda s: s.finish(result.finish_reason, result.generated_tokens, cached, result.seed))
        # Calls end the answer only when it ended by itself: cut by max_tokens, it says "length".
        finish_reason = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
        handle.push(Finished(finish_reason, generation.stop_string, result.prompt_tokens,
                             result.generated_tokens, cached, result.seed, handle.generation_id, entry.first or 0.0, resumed, calls,
                             result.draft_tokens, result.accepted_tokens))

"""A running sequence's state (nano-vllm's `Sequence`): its tokens, caches and seed, where it
stands against max_tokens, and why it stopped. The phases that act on it live elsewhere:
prefill (`prefill.py`), drafts (`drafting.py`), checkpoints (`checkpoints.py`), and
`Generation` (`generate.py`), which a scheduler drives."""

from __future__ import annotations

from collections.abc import Sequence

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import covered_tokens
from mlxkv_inference.generation.detokenizer import IncrementalDetokenizer
from mlxkv_inference.generation.loop import TokenStep
from mlxkv_inference.generation.results import FinishReason, GenerationResult, ResumePoint, TextDelta


class SequenceState:
    """One sequence. `prompt` holds the original prompt and, for a resumed sequence, the tokens
    generated before the restart (its caches hold them all); `max_new` counts what is left."""

    def __init__(self, prompt: Sequence[int], caches: list[LayerCache], seed: int, max_tokens: int,
                 detokenizer: IncrementalDetokenizer, resume: ResumePoint | None = None) -> None:
        self.caches = caches
        self.cached_tokens = covered_tokens(caches)
        self.seed = seed
        self.resume = resume
        self.replayed = list(resume.generated) if resume is not None else []
        self.prompt = list(prompt) + self.replayed
        self.original_prompt = len(prompt)
        self.max_new = max_tokens - len(self.replayed)
        self.detokenizer = detokenizer
        self.tokens: list[int] = []  # the answer's tokens: no EOS, none past a stop string
        self.yielded: list[int] = []  # every token the loop produced, EOS included
        self.emitted = 0  # tokens produced in this run (a resumed pending token included)
        self.last_step: TokenStep | None = None
        self.finish_reason: FinishReason = "length"
        self.cancelled = False
        self.done = False

    def replay(self) -> list[TextDelta]:
        """A resumed sequence's text so far, taken again (its caches already hold the tokens)."""
        deltas = []
        for token in self.replayed:
            self.tokens.append(token)
            self.yielded.append(token)
            deltas.append(TextDelta(self.detokenizer.add(token), None))
        return deltas

    @property
    def awaits_pending(self) -> bool:
        """Whether the next token is a resumed sequence's pending one (sampled before the restart)."""
        return self.resume is not None and self.emitted == 0

    def take(self, step: TokenStep, eos: bool) -> list[TextDelta]:
        """Take the next token produced (`eos`: an end it stops at); its newly final text."""
        self.last_step = step
        self.emitted += 1
        if self.emitted >= self.max_new:
            self.done = True
        self.yielded.append(step.token)
        if eos:
            self.stop("stop")
            return []
        self.tokens.append(step.token)
        text = self.detokenizer.add(step.token)
        if self.detokenizer.stopped:
            self.stop("stop")
        return [TextDelta(text, step)]

    def stop(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.done = True

    def history(self) -> list[int]:
        """The original prompt and the tokens read so far (what a proposer drafts after)."""
        return self.prompt[: self.original_prompt] + self.yielded

    def fed_tokens(self) -> list[int]:
        """The tokens the caches hold now: the prompt and the generated tokens fed so far."""
        return (self.prompt + self.yielded)[: covered_tokens(self.caches)]

    @property
    def decoded(self) -> int:
        """Tokens of the answer produced in this run (not replayed)."""
        return len(self.tokens) - len(self.replayed)

    def result(self, rates: tuple[float, float, float], drafted: int, accepted: int) -> GenerationResult:
        """The result of the finished sequence: `rates` are its time to first token and prefill
        and decode tokens a second; `drafted`/`accepted` its speculative rounds' drafts."""
        ttft, prefill_tps, decode_tps = rates
        return GenerationResult(
            token_ids=tuple(self.tokens), text=self.detokenizer.text, finish_reason=self.finish_reason,
            prompt_tokens=self.original_prompt, cached_tokens=self.cached_tokens, generated_tokens=len(self.tokens),
            seed=self.seed, ttft_s=ttft, prefill_tps=prefill_tps, decode_tps=decode_tps,
            draft_tokens=drafted, accepted_tokens=accepted,
        )

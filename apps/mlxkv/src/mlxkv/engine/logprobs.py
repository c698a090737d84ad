"""Logprobs a request asked for: measured from a step's log-probabilities, kept in generation
checkpoints, rendered as the API's `TokenLogprob`. Sent and replayed logprobs go through the same
`render`, so a resumed request answers exactly what the uninterrupted one would have."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from mlxkv_inference import TokenStep
from mlxkv_inference.generation.constraint import llg_tokenizer
from mlxkv_inference.generation.results import CheckpointState
from mlxkv_inference.tokenizer.protocol import Tokenizer
from mlxkv_serve import TokenLogprob
from mlxkv_state.header import TokenLogprobs


def measure(logprobs: mx.array, token: int, top: int) -> TokenLogprobs:
    """`token`'s log-probability and the `top` most likely tokens, from a step's logprobs."""
    ids = [int(i) for i in mx.argsort(-logprobs)[:top].tolist()] if top > 0 else []  # type: ignore[union-attr, arg-type]
    return TokenLogprobs(_float(logprobs[token]), tuple((i, _float(logprobs[i])) for i in ids))


def render(tokenizer: Tokenizer, token: int, measured: TokenLogprobs) -> TokenLogprob:
    text, raw = _piece(tokenizer, token)
    alternatives = tuple((alt, lp, alt_raw) for (alt, alt_raw), lp in ((_piece(tokenizer, i), lp) for i, lp in measured.top))
    return TokenLogprob(text, measured.logprob, raw, alternatives)


def _piece(tokenizer: Tokenizer, token: int) -> tuple[str, tuple[int, ...]]:
    """A token's text and the bytes it stands for. A token holding part of a character decodes to
    U+FFFD: its own bytes come from the vocabulary (via llguidance's view of it), so a client can
    join a character's pieces back together, as the `bytes` field is for."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text, tuple(text.encode())
    try:
        return text, tuple(llg_tokenizer(tokenizer).decode_bytes([token]))
    except ValueError:  # no `tokenizers` backend to read the vocabulary from
        return text, tuple(text.encode())


@dataclass(slots=True)
class LogprobTrail:
    """The logprobs one generation sent, token by token; a resumed one replays its checkpoint's
    first (for the generated tokens, then the pending one, whose step ran before the restart)."""

    top: int
    replay_tokens: tuple[int, ...] = ()
    replay: tuple[TokenLogprobs, ...] = ()
    sent: list[TokenLogprobs] = field(default_factory=list)

    def next(self, step: TokenStep | None) -> tuple[int, TokenLogprobs]:
        """The token and logprobs of the next generated token (`step` is None when replayed)."""
        index = len(self.sent)
        if index < len(self.replay):
            token, measured = self.replay_tokens[index], self.replay[index]
        else:
            assert step is not None and step.logprobs.size > 0, "a decoded token comes with its logprobs"
            token, measured = step.token, measure(step.logprobs, step.token, self.top)
        self.sent.append(measured)
        return token, measured

    def for_checkpoint(self, state: CheckpointState) -> tuple[TokenLogprobs, ...]:
        assert len(self.sent) == len(state.generated), "the checkpoint follows the last token sent"
        return (*self.sent, measure(state.pending_logprobs, state.pending, self.top))

    def fits(self, logprobs: Sequence[TokenLogprobs] | None) -> bool:
        """Whether a checkpoint's logprobs can answer this request."""
        return logprobs is not None and all(len(m.top) == self.top for m in logprobs)


def _float(value: mx.array) -> float:
    out = value.item()
    assert isinstance(out, float)
    return out

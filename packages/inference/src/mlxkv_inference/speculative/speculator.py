"""One generation's speculation: its proposer, how many drafts a round verifies, and its counts.

The draft length maximises expected tokens per unit of step time: with a per-draft acceptance
rate a (decayed counts of this sequence's rounds), k drafts yield E(k) = (1 - a^(k+1)) / (1 - a)
tokens for the cost of k more rows in the step's forward (`StepCosts`, measured on the running
machine: one more row costs a lone sequence more than it costs a step already running eight),
plus, for a draft model, the measured time of drafting k tokens (not of its reading a whole
prompt before its first drafts, once a prompt). In a step shared by n generations the step's
tokens count, not this one's: its drafts make every row wait, so the gain is
(n - 1 + E(k)) / (n * cost) (E(k) / cost alone): generations judging their own tokens alone
together slow a batch.
A step where no generation drafts may be pipelined (`BatchScheduler`: the next step is built while
this one runs), and one draft anywhere forgoes that for every row: asked about such a step
(`pipelining`), a generation counts that loss too.
In a copy (prompt lookup's match runs `COPY_RUN` tokens back, n-gram and aligned tokens before
it) every draft counts as accepted, with no margin: the rate, an average over the sequence's
rounds, does not see that a copy goes on until its edit point. A shorter match is evidence too:
its drafts have their own rate, by how many tokens the match runs back (from 2, 4 and 8), which
starts from Laplace's rule of succession at that length ((m + 1) / (m + 2), the chance that text
which went on matching m times goes on once more) and then follows the sequence's own rounds
(replayed on `tools.bench_speculative`'s answers: 3-15% fewer rounds, never modelled slower). Where no k beats a plain step,
the round is a plain step: speculation off where it loses. Prompt
lookup drafts cost nothing, so while off it still checks its guesses against the tokens produced
and turns itself back on when they start matching; a draft model is retried with one draft after
`RETRY_EVERY` plain steps, twice as many after each retry that misses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from mlxkv_inference.speculative.proposers import DraftModel, Proposer, PromptLookup
from mlxkv_inference.speculative.speculation import SpeculativeParams
from mlxkv_inference.step_costs import StepCosts

DECAY = 0.9  # weight of earlier rounds in the acceptance estimate
RETRY_EVERY = 16
MAX_RETRY_EVERY = 256
GAIN_MARGIN = 1.12  # a longer round must beat the best shorter one by this much (sampling and rollback are extra)
# What pipelining gains a batched step: unpipelined over pipelined seconds (see docs/benchmarks.md).
PIPELINING_GAIN = 1.12
# Matched tokens from which prompt lookup's drafts count as a copy in progress: chosen with
# `tools.bench_speculative` (shorter runs made some non-copy answers slower).
COPY_RUN = 16
MATCH_BUCKETS = (2, 4, 8)  # matched-token counts from which prompt lookup's drafts have a rate of their own
MATCH_PRIOR_WEIGHT = 2.0  # rounds' worth of evidence the rule of succession starts each of those rates with


def _match_bucket(matched: int) -> int:
    """0 below MATCH_BUCKETS (the sequence's own rate), else 1 + the bucket's index."""
    return sum(matched >= bound for bound in MATCH_BUCKETS)


class Speculator:
    def __init__(self, params: SpeculativeParams, proposer: Proposer, costs: StepCosts) -> None:
        self.params = params
        self._proposer = proposer
        self._costs = costs
        self._free = isinstance(proposer, PromptLookup)
        self._hits = 1.0  # decayed accepted drafts (a prior of one hit in two)
        self._misses = 1.0  # decayed rejected drafts
        # [hits, misses] of prompt lookup's drafts by match length (`_match_bucket` - 1)
        self._by_match = [[MATCH_PRIOR_WEIGHT * (m + 1) / (m + 2), MATCH_PRIOR_WEIGHT / (m + 2)] for m in MATCH_BUCKETS]
        self._bucket = 0  # the current round's
        self._shadow: list[int] = []
        self._idle_steps = 0
        self._retry_every = RETRY_EVERY
        self._retrying = False
        self._draft_seconds = 0.0  # a draft model's seconds a drafted token (0 until measured)
        self.drafted = 0  # drafts verified
        self.accepted = 0  # drafts accepted

    @property
    def acceptance(self) -> float:
        return self._hits / (self._hits + self._misses)

    def drafts(self, history: Sequence[int], limit: int, batch: int = 1, sequences: int = 1,
               pipelining: bool = False) -> list[int]:
        """The drafts the next step verifies (empty: a plain step); at most `limit`. `batch`:
        the rows the step feeds besides these drafts (they make each draft row relatively cheaper);
        `sequences`: the generations sharing the step (this one included); `pipelining`: the step
        is pipelined unless this generation drafts."""
        self._shadow = []
        if limit < 1:
            return []
        guess: list[int] = []
        copying = False
        self._bucket = 0
        if isinstance(self._proposer, PromptLookup):  # drafts cost nothing: looked up before planning
            guess, matched = self._proposer.lookup(history, limit)
            # not for a step that would be pipelined: `plans_drafts` has answered for it, before
            # the token it drafts after was known
            if not pipelining:
                copying, self._bucket = matched >= COPY_RUN, _match_bucket(matched)
        k, retry = self._plan(limit, batch, sequences, pipelining, copying, self._bucket)
        if k == 0:
            self._idle_steps += 1
            self._shadow = guess[:1]  # while off, prompt lookup still guesses the next token, for `observe` to check
            return []
        self._retrying = self._retrying or retry
        self._idle_steps = 0
        if self._free:
            return guess[:k]
        started = time.perf_counter()
        drafts = self._proposer.propose(history, k)
        if drafts:
            spent = time.perf_counter() - started
            if isinstance(self._proposer, DraftModel):  # once a prompt: not what drafting costs a round
                spent -= self._proposer.catch_up_s
            seconds = spent / len(drafts)
            self._draft_seconds = seconds if not self._draft_seconds else 0.8 * self._draft_seconds + 0.2 * seconds
        return drafts

    def plans_drafts(self, limit: int, batch: int = 1, sequences: int = 1, pipelining: bool = False) -> bool:
        """Whether `drafts` with these arguments would draft, asked before the token it drafts
        after is known (a pipelined step)."""
        return limit >= 1 and self._plan(limit, batch, sequences, pipelining)[0] > 0

    def _plan(self, limit: int, batch: int, sequences: int, pipelining: bool, copying: bool = False,
              bucket: int = 0) -> tuple[int, bool]:
        """(drafts the next step verifies, whether that is a draft model's retry): the adaptive
        length (`copying`: prompt lookup's match is a copy in progress; `bucket`: its length's
        rate, `_match_bucket`, 0 for the sequence's own); where it is none, one
        draft for a draft model whose plain steps, this one counted, reached `_retry_every`."""
        k = self._length(limit, max(batch, 1), max(sequences, 1), pipelining, copying, bucket)
        if k or self._free or self._idle_steps + 1 < self._retry_every:
            return k, False
        return 1, True

    def observe(self, drafts: Sequence[int], produced: Sequence[int]) -> None:
        """Tokens a step produced (sampled by the target) after verifying `drafts`."""
        guessed = list(drafts) or self._shadow
        self._shadow = []  # a guess is checked once
        if not guessed or not produced:
            return
        accepted = 0
        for draft, token in zip(guessed, produced):
            if draft != token:
                break
            accepted += 1
        rejected = 1 if accepted < len(guessed) and accepted < len(produced) else 0
        self._hits = DECAY * self._hits + accepted
        self._misses = DECAY * self._misses + rejected
        if self._bucket:
            counts = self._by_match[self._bucket - 1]
            counts[0], counts[1] = DECAY * counts[0] + accepted, DECAY * counts[1] + rejected
        if drafts and self._retrying:
            self._retrying = False
            self._retry_every = RETRY_EVERY if accepted else min(2 * self._retry_every, MAX_RETRY_EVERY)
        if drafts:
            self.drafted += len(drafts)
            self.accepted += min(accepted, len(produced) - 1)

    def _length(self, limit: int, batch: int, sequences: int, pipelining: bool, copying: bool, bucket: int) -> int:
        if not self.params.adaptive:
            return limit
        hits, misses = self._by_match[bucket - 1] if bucket else (self._hits, self._misses)
        rate = min(hits / (hits + misses), 0.999)
        margin = 1.0 if copying else GAIN_MARGIN
        step = self._costs.seconds(batch)
        drafting = self._draft_seconds / step if step else 0.0  # a drafted token, in steps
        forgone = PIPELINING_GAIN if pipelining else 1.0
        best_k, best = 0, 1.0
        for k in range(1, limit + 1):
            expected = k + 1.0 if copying else (1 - rate ** (k + 1)) / (1 - rate)
            cost = self._costs.relative(batch + k, batch) * forgone + k * drafting
            gain = (sequences - 1 + expected) / (sequences * cost)
            if gain > best * margin:
                best_k, best = k, gain
        return best_k

"""One generation's speculation: its proposer and adaptive draft length (`speculative/`), the
drafts of the step open, and how many drafts a round may verify exactly from where it stands."""

from __future__ import annotations

from mlxkv_inference.adapters.files import AdapterStack
from mlxkv_inference.binding import MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.rounds import round_fits
from mlxkv_inference.generation.checkpoints import CheckpointSchedule
from mlxkv_inference.generation.sequence import SequenceState
from mlxkv_inference.speculative.proposers import DraftModel, DraftState, PromptLookup, Proposer, draft_adapters
from mlxkv_inference.speculative.speculation import SpeculativeParams
from mlxkv_inference.speculative.speculator import Speculator


class Drafting:
    """Drafts for `sequence`'s steps: none where the model's forward cannot verify them exactly
    (`verifies_positions`), else as many as one forward verifies exactly: within max_tokens, not
    past a checkpoint (one may fall only on a round's last token, when the caches hold exactly
    the tokens before it), and where `round_fits` allows."""

    def __init__(self, binding: MlxAutoregressiveBinding, sequence: SequenceState, checkpoints: CheckpointSchedule,
                 params: SpeculativeParams, draft: MlxAutoregressiveBinding | None) -> None:
        self._binding = binding
        self._sequence = sequence
        self._checkpoints = checkpoints
        resumed = sequence.resume.draft if sequence.resume is not None else None
        shares = draft is not None and draft.prefix_of is binding
        adapters = draft_adapters(binding, draft, sequence.caches) if draft is not None else AdapterStack()
        proposer = make_proposer(params, draft, resumed, sequence.caches if shares else None, adapters)
        self.speculator = Speculator(params, proposer, binding.step_costs) if proposer is not None else None
        self.draft_model = proposer if isinstance(proposer, DraftModel) else None
        self.drafts: list[int] = []  # the open round's drafts (empty: a plain step)

    def draft(self, batch: int, sequences: int, most: int | None = None) -> list[int]:
        """Open the next step's round: its drafts (at most `most`), given the step's `batch` rows
        besides them and the `sequences` sharing it."""
        spec = self._speculating
        if spec is None:
            self.drafts = []
        else:
            limit = self._limit(spec, self._sequence.emitted)
            self.drafts = spec.drafts(self._sequence.history(), limit if most is None else min(limit, most), batch, sequences)
        return self.drafts

    def would_draft_ahead(self, produced: int, sequences: int) -> bool:
        """Whether a pipelined step after `produced` tokens would draft (it may not)."""
        spec = self._speculating
        return spec is not None and spec.plans_drafts(self._limit(spec, produced), sequences, sequences, pipelining=True)

    def plain_ahead(self, produced: int, sequences: int) -> None:
        """Count a pipelined step after `produced` tokens as a plain one (as a plain step's)."""
        spec = self._speculating
        if spec is not None:
            drafts = spec.drafts(self._sequence.history(), self._limit(spec, produced), sequences, sequences, pipelining=True)
            assert not drafts, "RunAhead.may_run found that this step drafts nothing"

    def close(self, produced: list[int] | None) -> None:
        """Close the open round: what its step produced (None: no step ran) goes to the adaptive length."""
        if self.speculator is not None and produced is not None:
            self.speculator.observe(self.drafts, produced)
        self.drafts = []

    def observe_ahead(self, token: int) -> None:
        """A pipelined step's token, read: a plain step's."""
        if self.speculator is not None:
            self.speculator.observe([], [token])

    @property
    def drafted(self) -> int:
        return self.speculator.drafted if self.speculator is not None else 0

    @property
    def accepted(self) -> int:
        return self.speculator.accepted if self.speculator is not None else 0

    @property
    def _speculating(self) -> Speculator | None:
        return self.speculator if self.speculator is not None and self._binding.verifies_positions() else None

    def _limit(self, spec: Speculator, n: int) -> int:
        """The most drafts a round after `n` produced tokens may verify (see the class)."""
        limit = min(spec.params.num_draft_tokens, self._sequence.max_new - n - 1)
        checkpoint = self._checkpoints.next_at(n)
        if checkpoint is not None:
            limit = min(limit, checkpoint - n)
        return min(limit, round_fits(self._sequence.caches, limit + 1, self._binding.kv_scheme, self._binding.verifies_full_rings) - 1)


def make_proposer(params: SpeculativeParams, draft: MlxAutoregressiveBinding | None,
                  draft_state: DraftState | None, target: list[LayerCache] | None,
                  adapters: AdapterStack = AdapterStack()) -> Proposer | None:
    if params.mode == "off":
        return None
    if params.mode == "prompt_lookup":
        return PromptLookup(params.ngram_min, params.ngram_max)
    if draft is None:
        raise ValueError("speculative mode 'draft' needs a draft model (serve/generate --draft-model or --draft-layers)")
    return DraftModel(draft, draft_state, target, adapters)

"""Generation through the tiered prompt cache: fetch the longest cached prefix, snapshot the
prompt while prefilling, publish the settled state afterwards."""

from __future__ import annotations

from collections.abc import Sequence

from mlxkv_inference.adapters.bank import namespace_of
from mlxkv_inference.adapters.files import AdapterStack
from mlxkv_inference.binding import MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.reuse import all_trimmable
from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.generation.hooks import GenerationHooks, OnCheckpoint, PrefillProgress
from mlxkv_inference.generation.results import GenerationParams, ResumePoint
from mlxkv_inference.prompt_cache.cold_tier import ColdRestored
from mlxkv_inference.prompt_cache.tiered import Fetched, TieredPromptCache


class CachedGenerator:
    """Runs generations for one model over a `TieredPromptCache` (or none); `draft` is the
    draft model of generations speculating in mode "draft"."""

    def __init__(self, binding: MlxAutoregressiveBinding, tiers: TieredPromptCache | None,
                 draft: MlxAutoregressiveBinding | None = None) -> None:
        self.binding = binding
        self.tiers = tiers
        self.draft = draft

    def start(
        self,
        prompt: Sequence[int],
        params: GenerationParams,
        adapters: AdapterStack = AdapterStack(),
        *,
        history_end: int | None = None,
        resume: tuple[list[LayerCache], ResumePoint] | None = None,
        read: ColdRestored | None = None,
        checkpoint_every: int = 0,
        on_checkpoint: OnCheckpoint | None = None,
        on_prefill_progress: PrefillProgress | None = None,
    ) -> Generation:
        """A generation whose caches start from the longest cached prefix of `prompt`.

        Prefill pauses to snapshot the prompt state at `history_end` (the end of a chat's templated
        history, before the new assistant turn) and at the end of the prompt, so the next turn hits
        even when sliding-window or recurrent layers make the caches untrimmable.

        With `resume` (a checkpoint's caches and where it stood) the generation continues from
        there instead: nothing is fetched or prefilled. `read`: the cold tier's prefix of `prompt`,
        read ahead off this thread (`TieredPromptCache.read_cold`, under the same adapters).

        `adapters`: what the generation runs under; their namespace (`AdapterStack.ns`) is the only
        one whose cached prefixes it reuses, and the one it publishes its states under.
        """
        if resume is not None:
            hooks = GenerationHooks(checkpoint_every=checkpoint_every, on_checkpoint=on_checkpoint)
            return Generation(self.binding, prompt, params, self._tagged(resume[0], adapters), resume=resume[1],
                              draft=self.draft, hooks=hooks)
        ns = adapters.ns
        fetched = self.tiers.fetch(prompt, ns, read) if self.tiers is not None else Fetched(None, 0, None)
        points = [len(prompt) - 1] + ([history_end] if history_end is not None else [])
        hooks = GenerationHooks(
            snapshot_at=points if self.tiers is not None else (),
            on_snapshot=lambda tokens, caches: self._snapshot(tokens, caches, ns),
            checkpoint_every=checkpoint_every, on_checkpoint=on_checkpoint, on_prefill_progress=on_prefill_progress,
        )
        return Generation(self.binding, prompt, params, self._tagged(fetched.caches, adapters), draft=self.draft, hooks=hooks)

    def settle(self, generation: Generation) -> None:
        """Publish the state a finished (or stopped) generation left in its caches (under the
        namespace of the adapters they were computed with)."""
        self._publish(generation.fed_tokens(), generation.caches, namespace_of(generation.caches))

    def _tagged(self, caches: list[LayerCache] | None, adapters: AdapterStack) -> list[LayerCache] | None:
        if not adapters.adapters:
            return caches
        return self.binding.adapters.tag(caches if caches is not None else self.binding.make_cache(), adapters)

    def _snapshot(self, tokens: Sequence[int], caches: Sequence[LayerCache], ns: str) -> None:
        # NOTE: trimmable caches skip it: the settled state, trimmed, serves the same prefixes,
        # and writing both would double the SSD traffic of every turn.
        if not all_trimmable(caches):
            self._publish(tokens, caches, ns)

    def _publish(self, tokens: Sequence[int], caches: Sequence[LayerCache], ns: str) -> None:
        if self.tiers is not None:
            self.tiers.publish(tokens, caches, ns)

"""Binds the SSD store into the inference package's structural `ColdTier` Protocol and the
engine's `CheckpointStore` Protocol.

The store is identity-bound: it is opened for one model binding (model id, tokenizer hash,
config fingerprint), so KV is never reused across identities. A server with a draft model opens
a second store in the same directory under the draft's identity, for the draft's part of each
generation checkpoint; the two split the byte cap in proportion to what a token's KV costs each
(both hold the same generations' tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
import logging
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.speculative.proposers import DraftState
from mlxkv_inference.prompt_cache import ColdHit, ColdRestored, ColdTier, TieredPromptCache
from mlxkv_ssd_cache import (
    DEFAULT_CHECKPOINT_TTL_S, CacheHit, KvIdentity, RestoredState, SsdCacheStore, StoreStats,
)
from mlxkv_state.header import GenerationCheckpoint

from mlxkv.engine.checkpoints import RestoredCheckpoint

if TYPE_CHECKING:
    from mlxkv_remote_cache import RemoteStore

    from mlxkv.engine.remote_tier import RemoteColdTier

log = logging.getLogger(__name__)

A = TypeVar("A")
B = TypeVar("B")


class SsdColdTier:
    """`ColdTier` and `CheckpointStore` over an `SsdCacheStore` (and `draft_store`, the draft
    model's, for the draft's caches of each checkpoint)."""

    def __init__(self, store: SsdCacheStore, draft_store: SsdCacheStore | None = None,
                 draft_signatures: Sequence[str] = ()) -> None:
        self.ssd = store
        self.draft_ssd = draft_store
        self._draft_signatures = list(draft_signatures)  # the draft model's cache kinds, layer by layer

    def find(self, prompt: Sequence[int], ns: str) -> ColdHit | None:
        return _cold_hit(self.ssd.find(prompt, ns))

    def find_exact(self, tokens: Sequence[int], ns: str) -> ColdHit | None:
        return _cold_hit(self.ssd.find_exact(tokens, ns))

    def restore(self, hit: ColdHit) -> ColdRestored | None:
        return _restored(self.ssd.restore(_cache_hit(hit)))

    def restore_async(self, hit: ColdHit) -> Future[ColdRestored | None]:
        return _mapped(self.ssd.restore_async(_cache_hit(hit)), _restored)

    def store(self, tokens: Sequence[int], caches: Sequence[LayerCache], ns: str) -> bool:
        return self.ssd.store(tokens, caches, ns)

    def stats(self) -> StoreStats:
        """The two stores' counts together (the draft's holds checkpoints only)."""
        own = self.ssd.stats()
        if self.draft_ssd is None:
            return own
        draft = self.draft_ssd.stats()
        return StoreStats(own.entries, own.bytes + draft.bytes, own.max_bytes + draft.max_bytes,
                          own.quarantined + draft.quarantined, own.evictions + draft.evictions, own.checkpoints,
                          own.expired_checkpoints)

    def save_checkpoint(self, tokens: Sequence[int], caches: Sequence[LayerCache], checkpoint: GenerationCheckpoint,
                        draft: DraftState | None = None) -> bool:
        """The target's checkpoint, then the draft's (a crash between them leaves the draft's
        previous one: older, so still a prefix of the same generation, and loaded as such)."""
        saved = self.ssd.save_checkpoint(tokens, caches, checkpoint)
        if saved and draft is not None and self.draft_ssd is not None:
            self.draft_ssd.save_checkpoint(draft.tokens, draft.caches, checkpoint)
        return saved

    def load_checkpoint(self, key: str) -> RestoredCheckpoint | None:
        state = self.ssd.load_checkpoint(key)
        if state is None or state.generation_checkpoint is None:
            return None
        return RestoredCheckpoint(state.tokens, state.caches, state.generation_checkpoint, self._load_draft(key, state.tokens))

    def remove_checkpoint(self, key: str) -> None:
        self.ssd.remove_checkpoint(key)
        if self.draft_ssd is not None:
            self.draft_ssd.remove_checkpoint(key)

    def _load_draft(self, key: str, tokens: Sequence[int]) -> DraftState | None:
        """The draft's checkpoint of `key` if it holds a prefix of `tokens` in caches of the
        draft's kinds that cover exactly its tokens; else None, and the draft reads the history
        again, as it would without one."""
        if self.draft_ssd is None:
            return None
        try:
            state = self.draft_ssd.load_checkpoint(key)
        except Exception:  # noqa: BLE001 - the draft's part is an optimisation: any fault is a miss
            log.warning("the draft checkpoint of %s could not be read; the draft starts over", key[:12], exc_info=True)
            return None
        if state is None or tuple(tokens[: len(state.tokens)]) != state.tokens:
            return None
        if [c.signature() for c in state.caches] != self._draft_signatures or any(c.offset != len(state.tokens) for c in state.caches):
            log.warning("the draft checkpoint of %s does not fit the draft model; the draft starts over", key[:12])
            return None
        return DraftState(state.tokens, state.caches)


def open_cold_tier(
    binding: MlxAutoregressiveBinding, directory: Path, max_bytes: int, checkpoint_ttl_s: float = DEFAULT_CHECKPOINT_TTL_S,
    draft: MlxAutoregressiveBinding | None = None,
) -> SsdColdTier:
    """The store of `binding` in `directory`, and with `draft` the draft model's beside it (the
    cap `max_bytes` split between them by what a token's KV costs each). None for a layer-skip
    draft (it copies the target's KV) or one with the target's identity (two stores would write
    the same checkpoint file)."""
    if draft is not None and (draft.prefix_of is not None or _identity(draft) == _identity(binding)):
        draft = None
    draft_bytes = 0
    if draft is not None:
        target_cost, draft_cost = token_kv_bytes(binding), token_kv_bytes(draft)
        draft_bytes = max_bytes * draft_cost // max(target_cost + draft_cost, 1)
    store = SsdCacheStore(directory, _identity(binding), max_bytes - draft_bytes, checkpoint_ttl_s=checkpoint_ttl_s)
    if draft is None or draft_bytes < 1:
        return SsdColdTier(store)
    draft_store = SsdCacheStore(directory, _identity(draft), draft_bytes, checkpoint_ttl_s=checkpoint_ttl_s)
    return SsdColdTier(store, draft_store, [c.signature() for c in draft.make_cache()])


def build_tiers(
    binding: MlxAutoregressiveBinding, *, ram_bytes: int, ssd_dir: Path | None, ssd_bytes: int,
    checkpoint_ttl_s: float = DEFAULT_CHECKPOINT_TTL_S, draft: MlxAutoregressiveBinding | None = None,
    remote: Callable[[KvIdentity], RemoteStore] | None = None,
) -> tuple[TieredPromptCache, SsdColdTier | RemoteColdTier | None]:
    """RAM over the SSD store in `ssd_dir`, and with `remote` (opens the shared store of an
    identity) the shared tier under the SSD."""
    ssd = open_cold_tier(binding, ssd_dir, ssd_bytes, checkpoint_ttl_s, draft) if ssd_dir is not None else None
    cold: SsdColdTier | RemoteColdTier | None = ssd
    if ssd is not None and remote is not None:
        from mlxkv.engine.remote_tier import RemoteColdTier  # it builds on SsdColdTier, defined here

        cold = RemoteColdTier(ssd, remote(_identity(binding)))
    tier: ColdTier | None = cold
    return TieredPromptCache(ram_bytes, tier), cold


def token_kv_bytes(binding: MlxAutoregressiveBinding) -> int:
    """Bytes one token's KV takes in `binding`'s caches (a recurrent layer counts its whole state):
    measured on scratch caches fed one token."""
    caches = binding.make_cache()
    binding.feed([0], caches)
    return sum(c.bytes_per_token() or c.nbytes for c in caches)


def _identity(binding: MlxAutoregressiveBinding) -> KvIdentity:
    return KvIdentity(binding.model_id, binding.tokenizer_hash, binding.config_fingerprint)


def _cold_hit(hit: CacheHit | None) -> ColdHit | None:
    return None if hit is None else ColdHit(hit.entry_id, hit.ns, hit.num_tokens, hit.entry_tokens)


def _cache_hit(hit: ColdHit) -> CacheHit:
    return CacheHit(hit.handle, hit.ns, hit.num_tokens, hit.entry_tokens)


def _restored(state: RestoredState | None) -> ColdRestored | None:
    return None if state is None else ColdRestored(state.caches, state.tokens)


def _mapped(inner: Future[A], convert: Callable[[A], B]) -> Future[B]:
    """A future resolving to `convert(inner's result)` (or to inner's exception)."""
    outer: Future[B] = Future()

    def relay(done: Future[A]) -> None:
        error = done.exception()
        if error is not None:
            outer.set_exception(error)
        else:
            outer.set_result(convert(done.result()))

    inner.add_done_callback(relay)
    return outer

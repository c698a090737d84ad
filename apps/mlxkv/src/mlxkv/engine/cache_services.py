"""Binds the SSD store into the inference package's structural `ColdTier` Protocol and the
engine's `CheckpointStore` Protocol.

The store is identity-bound: it is opened for one model binding (model id, tokenizer hash,
config fingerprint), so KV is never reused across identities.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import mlx.core as mx

from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.prompt_cache import ColdHit, ColdRestored, ColdTier, TieredPromptCache
from mlxkv_ssd_cache import (
    DEFAULT_CHECKPOINT_TTL_S, Attachments, CacheHit, KvIdentity, RestoredState, SsdCacheStore, StoreStats,
)
from mlxkv_state.header import GenerationCheckpoint

from mlxkv.engine.checkpoints import RestoredCheckpoint

A = TypeVar("A")
B = TypeVar("B")


class SsdColdTier:
    """`ColdTier` and `CheckpointStore` over an `SsdCacheStore`."""

    def __init__(self, store: SsdCacheStore) -> None:
        self.ssd = store

    def find(self, prompt: Sequence[int], ns: str) -> ColdHit | None:
        return _cold_hit(self.ssd.find(prompt, ns))

    def find_exact(self, tokens: Sequence[int], ns: str) -> ColdHit | None:
        return _cold_hit(self.ssd.find_exact(tokens, ns))

    def restore(self, hit: ColdHit) -> ColdRestored | None:
        return _restored(self.ssd.restore(_cache_hit(hit)))

    def restore_async(self, hit: ColdHit) -> Future[ColdRestored | None]:
        return _mapped(self.ssd.restore_async(_cache_hit(hit)), _restored)

    def restore_object_async(self, key: str, ns: str) -> Future[Mapping[str, mx.array] | None]:
        return _mapped(self.ssd.restore_object_async(key, ns), lambda tensors: tensors)

    def store(
        self,
        tokens: Sequence[int],
        caches: Sequence[LayerCache],
        ns: str,
        attachments: Mapping[str, Mapping[str, mx.array]] | None = None,
    ) -> bool:
        groups = {name: (name, dict(tensors)) for name, tensors in (attachments or {}).items()}
        return self.ssd.store(tokens, caches, ns, Attachments(groups) if groups else None)

    def stats(self) -> StoreStats:
        return self.ssd.stats()

    def save_checkpoint(self, tokens: Sequence[int], caches: Sequence[LayerCache], checkpoint: GenerationCheckpoint) -> bool:
        return self.ssd.save_checkpoint(tokens, caches, checkpoint)

    def load_checkpoint(self, key: str) -> RestoredCheckpoint | None:
        state = self.ssd.load_checkpoint(key)
        if state is None or state.generation_checkpoint is None:
            return None
        return RestoredCheckpoint(state.tokens, state.caches, state.generation_checkpoint)

    def remove_checkpoint(self, key: str) -> None:
        self.ssd.remove_checkpoint(key)


def open_cold_tier(
    binding: MlxAutoregressiveBinding, directory: Path, max_bytes: int, checkpoint_ttl_s: float = DEFAULT_CHECKPOINT_TTL_S
) -> SsdColdTier:
    identity = KvIdentity(binding.model_id, binding.tokenizer_hash, binding.config_fingerprint)
    return SsdColdTier(SsdCacheStore(directory, identity, max_bytes, checkpoint_ttl_s=checkpoint_ttl_s))


def build_tiers(
    binding: MlxAutoregressiveBinding, *, ram_bytes: int, ssd_dir: Path | None, ssd_bytes: int,
    checkpoint_ttl_s: float = DEFAULT_CHECKPOINT_TTL_S,
) -> tuple[TieredPromptCache, SsdColdTier | None]:
    cold = open_cold_tier(binding, ssd_dir, ssd_bytes, checkpoint_ttl_s) if ssd_dir is not None else None
    tier: ColdTier | None = cold
    return TieredPromptCache(ram_bytes, tier), cold


def _cold_hit(hit: CacheHit | None) -> ColdHit | None:
    return None if hit is None else ColdHit(hit.entry_id, hit.ns, hit.num_tokens, hit.entry_tokens)


def _cache_hit(hit: ColdHit) -> CacheHit:
    return CacheHit(hit.handle, hit.ns, hit.num_tokens, hit.entry_tokens)


def _restored(state: RestoredState | None) -> ColdRestored | None:
    if state is None:
        return None
    attachments = {name: tensors for name, (_, tensors) in state.attachments.groups.items()}
    return ColdRestored(state.caches, state.tokens, attachments)


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

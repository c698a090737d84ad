"""Generation checkpoints: the request key, and the writer that keeps the newest one per key.

    key = sha256(canonical request: prompt ids, every sampling and stop field, the logprobs asked
          for, namespace, model identity). A seed the server chose stays out of the key (it is stored in the checkpoint),
          so an identical retry finds the checkpoint and continues the same random stream.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from mlxkv_inference import GenerationParams
from mlxkv_inference.background_writer import BackgroundWriter, FlushReport
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.speculative.proposers import DraftState
from mlxkv_ssd_cache import KvIdentity, StoreStats
from mlxkv_state.header import GenerationCheckpoint


@dataclass(frozen=True, slots=True)
class RestoredCheckpoint:
    """A durable checkpoint: `caches` hold `tokens` (the prompt and the tokens generated so far);
    `draft`: the draft model's state, where it was kept and still fits `tokens`."""

    tokens: tuple[int, ...]
    caches: list[LayerCache]
    checkpoint: GenerationCheckpoint
    draft: DraftState | None = None


class CheckpointStore(Protocol):
    """Where the engine keeps generation checkpoints (the newest per request key, with the
    draft model's state where there is one), and the stats of the store behind them."""

    def save_checkpoint(self, tokens: Sequence[int], caches: Sequence[LayerCache], checkpoint: GenerationCheckpoint,
                        draft: DraftState | None) -> bool: ...

    def load_checkpoint(self, key: str) -> RestoredCheckpoint | None: ...

    def remove_checkpoint(self, key: str) -> None: ...

    def stats(self) -> StoreStats: ...


def request_key(
    identity: KvIdentity, ns: str, prompt: Sequence[int], params: GenerationParams, top_logprobs: int | None = None
) -> str:
    sampling = asdict(params.sampling)
    sampling["logit_bias"] = sorted(params.sampling.logit_bias.items())
    canonical = {
        "model": [identity.model_id, identity.tokenizer_hash, identity.config_fingerprint],
        "ns": ns,
        "prompt": list(prompt),
        "sampling": sampling,  # holds the seed only when the request gave one
        "stop": list(params.stop),
        "max_tokens": params.max_tokens,
    }
    if params.grammar is not None:  # absent: keys of unconstrained requests stay as they were
        canonical["grammar"] = params.grammar.digest
    if top_logprobs is not None:  # a retry must find the logprobs it asks for (absent: keys stay as they were)
        canonical["top_logprobs"] = top_logprobs
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class CheckpointWriter:
    """Writes checkpoints behind decode (which never waits on it). Only the newest queued
    checkpoint of a key is written; a removal waits behind that key's running write."""

    def __init__(self, store: CheckpointStore) -> None:
        self._store = store
        self._writer = BackgroundWriter("mlxkv-checkpoints")

    @property
    def written(self) -> int:
        return self._writer.stats().written

    def save(self, tokens: Sequence[int], caches: list[LayerCache], checkpoint: GenerationCheckpoint,
             draft: DraftState | None = None) -> None:
        saved = tuple(tokens)
        self._writer.submit(checkpoint.key, lambda: self._store.save_checkpoint(saved, caches, checkpoint, draft))

    def remove(self, key: str) -> None:
        self._writer.submit(key, lambda: self._remove(key))

    def flush(self, timeout: float | None = None) -> FlushReport:
        return self._writer.flush(timeout)

    def close(self, timeout: float | None = None) -> FlushReport:
        return self._writer.close(timeout)

    def _remove(self, key: str) -> None:
        self._store.remove_checkpoint(key)

"""Generation checkpoints: the request key, and the writer that keeps the newest one per key.

    key = sha256(canonical request: prompt ids, every sampling and stop field, namespace, model
          identity). A seed the server chose stays out of the key (it is stored in the checkpoint),
          so an identical retry finds the checkpoint and continues the same random stream.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mlxkv_inference import GenerationParams
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_ssd_cache import KvIdentity, SsdCacheStore
from mlxkv_state.header import GenerationCheckpoint

log = logging.getLogger(__name__)


def request_key(identity: KvIdentity, ns: str, prompt: Sequence[int], params: GenerationParams) -> str:
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
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class _Save:
    tokens: tuple[int, ...]
    caches: list[LayerCache]
    checkpoint: GenerationCheckpoint


@dataclass(frozen=True, slots=True)
class _Remove:
    key: str


class CheckpointWriter:
    """A background thread writing checkpoints; decode never waits on it. Only the newest
    queued checkpoint of a key is written; a removal waits behind that key's writes."""

    def __init__(self, store: SsdCacheStore) -> None:
        self._store = store
        self._queue: queue.Queue[_Save | _Remove | None] = queue.Queue()
        self._latest: dict[str, _Save] = {}
        self._lock = threading.Condition()
        self._busy = 0
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="mlxkv-checkpoints", daemon=True)
        self._thread.start()

    def save(self, tokens: Sequence[int], caches: list[LayerCache], checkpoint: GenerationCheckpoint) -> None:
        job = _Save(tuple(tokens), caches, checkpoint)
        with self._lock:
            self._latest[checkpoint.key] = job
            self._busy += 1
        self._queue.put(job)

    def remove(self, key: str) -> None:
        with self._lock:
            self._latest.pop(key, None)
            self._busy += 1
        self._queue.put(_Remove(key))

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self._busy == 0, timeout)

    def close(self, timeout: float | None = None) -> bool:
        done = self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        return done

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if isinstance(job, _Remove):
                    self._store.remove_checkpoint(job.key)
                else:
                    with self._lock:
                        newest = self._latest.get(job.checkpoint.key) is job
                    if newest and self._store.save_checkpoint(job.tokens, job.caches, job.checkpoint):
                        self.written += 1
            except Exception as e:  # noqa: BLE001 - the writer must outlive any single fault
                log.warning("checkpoint job failed: %s", e)
            finally:
                with self._lock:
                    self._busy -= 1
                    self._lock.notify_all()

"""What the tiers hold of a prompt, for `POST /v1/cache/lookup`: RAM, then the cold tier (the SSD,
or the shared tier under it when its index holds a longer prefix). Index lookups only."""

from __future__ import annotations

from collections.abc import Sequence

from mlxkv_inference.prompt_cache import TieredPromptCache
from mlxkv_serve.engine import CachedPrefix

from mlxkv.engine.remote_tier import REMOTE

BASE_NS = ""  # the namespace requests without an adapter use


def held_prefix(tiers: TieredPromptCache | None, prompt: Sequence[int], ns: str = BASE_NS) -> CachedPrefix:
    if tiers is None:
        return CachedPrefix(len(prompt), 0, None)
    ram_tokens, cold = tiers.held(prompt, ns)
    if cold is not None:
        return CachedPrefix(len(prompt), cold.num_tokens, "remote" if cold.handle.startswith(REMOTE) else "ssd")
    return CachedPrefix(len(prompt), ram_tokens, "ram" if ram_tokens else None)

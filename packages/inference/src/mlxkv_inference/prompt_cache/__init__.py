"""The prompt cache: a RAM tier over the `ColdTier` Protocol, and the tiered cache joining them."""

from mlxkv_inference.prompt_cache.cold_tier import ColdHit, ColdRestored, ColdTier
from mlxkv_inference.prompt_cache.ram_tier import RamPromptCache, Taken
from mlxkv_inference.prompt_cache.tiered import Fetched, TieredPromptCache, TierStats

__all__ = ["ColdHit", "ColdRestored", "ColdTier", "Fetched", "RamPromptCache", "Taken", "TierStats", "TieredPromptCache"]

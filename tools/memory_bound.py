"""The RAM prompt tier under a byte cap: 50 distinct 1000-token prompts through a 64 MB tier.

Prints the tier's accounted bytes, MLX's active memory and the process RSS as it goes.
Run: `uv run python -m tools.memory_bound`.
"""

from __future__ import annotations

import resource

import mlx.core as mx

from mlxkv_inference import GenerationParams
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.prompt_cache import TieredPromptCache
from tests.factories import make_prompt, make_tiny_binding

CAP = 64 << 20
MB = 1 << 20


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / MB


def main() -> None:
    # 4 layers x 4 KV heads x 64 dims, float32: 8 KiB a token, ~8 MiB a 1000-token prompt state.
    binding = make_tiny_binding("llama", num_hidden_layers=4, num_key_value_heads=4, num_attention_heads=4, head_dim=64)
    tiers = TieredPromptCache(ram_max_bytes=CAP)
    generator = CachedGenerator(binding, tiers)
    start_rss = rss_mb()
    peak_tier = peak_rss = 0.0
    print(f"{'prompt':>6} {'tier MB':>8} {'entries':>7} {'MLX active MB':>13} {'RSS MB':>8}")
    for i in range(50):
        generation = generator.start(make_prompt(1000, seed=i), GenerationParams(max_tokens=2, ignore_eos=True))
        generation.run()
        generator.settle(generation)
        del generation
        stats = tiers.stats()
        peak_tier, peak_rss = max(peak_tier, stats.ram_bytes / MB), max(peak_rss, rss_mb())
        if i % 10 == 9:
            print(f"{i + 1:6d} {stats.ram_bytes / MB:8.1f} {stats.ram_entries:7d} {mx.get_active_memory() / MB:13.1f} {rss_mb():8.1f}")
    stats = tiers.stats()
    print(f"cap {CAP / MB:.0f} MB; tier peak {peak_tier:.1f} MB; evictions {stats.ram_evictions}; "
          f"RSS {start_rss:.0f} MB before, {rss_mb():.0f} MB after, peak {peak_rss:.0f} MB "
          f"(prompt states produced: {50 * 8} MB); MLX peak {mx.get_peak_memory() / MB:.0f} MB")


if __name__ == "__main__":
    main()

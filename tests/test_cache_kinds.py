"""Cache classes: offset, trim and size arithmetic per kind, and the contract they share."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv_inference import KvScheme
from mlxkv_inference.cache.contract import CacheTrimError, CompiledDecodeCache
from mlxkv_inference.cache.factory import make_caches, maybe_quantize
from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_inference.cache.quantized import QuantizedKVCache
from mlxkv_inference.cache.recurrent import RecurrentCache
from tests.factories import make_tiny_binding

HEADS, DIM = 2, 64


def kv(n: int, start: float = 0.0) -> tuple[mx.array, mx.array]:
    """n tokens of keys/values whose first element encodes the token position (for ring checks)."""
    base = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1)
    keys = mx.broadcast_to(base, (1, HEADS, n, DIM))
    return keys, keys + 0.5


def feed(cache: PlainKVCache | RotatingKVCache | QuantizedKVCache, n: int, *, one_by_one: bool = False) -> None:
    start = float(cache.offset)
    if one_by_one:
        for i in range(n):
            cache.update_and_fetch(*kv(1, start + i))
    else:
        cache.update_and_fetch(*kv(n, start))


def test_every_kind_implements_the_contract() -> None:
    caches: list[CompiledDecodeCache] = [PlainKVCache(), RotatingKVCache(8), QuantizedKVCache(64, 4), RecurrentCache(2)]
    assert all(isinstance(c, CompiledDecodeCache) for c in caches)
    signatures = [c.signature() for c in caches]
    assert all(signatures) and len(set(signatures)) == len(signatures)


def test_plain_cache_grows_in_256_steps_and_trims() -> None:
    cache = PlainKVCache()
    feed(cache, 300)
    assert (cache.offset, cache.keys.shape[2] if cache.keys is not None else 0) == (300, 512)
    assert cache.bytes_per_token() == HEADS * (DIM + DIM) * 4
    assert cache.is_trimmable() and cache.trim(50) == 50 and cache.offset == 250
    assert cache.trim(1000) == 250 and cache.offset == 0
    with pytest.raises(ValueError, match="trim count must be >= 0"):
        cache.trim(-1)


def test_rotating_cache_enters_ring_phase_when_full_and_refuses_trim() -> None:
    cache = RotatingKVCache(max_size=8, keep=2)
    feed(cache, 5, one_by_one=True)
    assert (cache.decode_phase(), cache.is_trimmable(), cache.ring_index) == ("concat", True, 5)
    feed(cache, 5, one_by_one=True)  # tokens 5..9: 8 fill the buffer, 8 and 9 overwrite slots 2 and 3
    assert (cache.offset, cache.decode_phase(), cache.is_trimmable(), cache.ring_index) == (10, "ring", False, 4)
    assert cache.keys is not None
    assert cache.keys[0, 0, :, 0].tolist() == [0, 1, 8, 9, 4, 5, 6, 7]  # keep=2 pins tokens 0 and 1
    with pytest.raises(CacheTrimError, match="wrapped at 8 tokens"):
        cache.trim(1)


def test_rotating_bypass_trim_shrinks_the_tail_right_after_a_multi_token_write() -> None:
    cache = RotatingKVCache(max_size=8)
    feed(cache, 10)  # one 10-token write: buffer holds all 10 in temporal order
    assert cache.keys is not None and cache.keys.shape[2] == 10
    assert cache.trim(3, bypass=True) == 3
    assert cache.offset == 7 and cache.keys.shape[2] == 7
    assert cache.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    feed(cache, 1)
    with pytest.raises(CacheTrimError, match="only possible right after a multi-token write"):
        cache.trim(1, bypass=True)


def test_quantized_conversion_at_start_offset_sets_minimum_reusable_offset() -> None:
    scheme = KvScheme(bits=8, group_size=64, quantized_start=16)
    caches: list[PlainKVCache | RotatingKVCache | QuantizedKVCache | RecurrentCache] = [PlainKVCache()]
    feed(caches[0], 10)  # type: ignore[arg-type]
    maybe_quantize(caches, scheme)
    assert isinstance(caches[0], PlainKVCache)
    feed(caches[0], 10)
    maybe_quantize(caches, scheme)
    quantized = caches[0]
    assert isinstance(quantized, QuantizedKVCache)
    assert (quantized.offset, quantized.minimum_reusable_offset, quantized.bits) == (20, 20, 8)
    # 8-bit packed keys and values (64 dims -> 16 words) plus float32 scales and biases per group.
    assert quantized.bytes_per_token() == 2 * HEADS * (16 * 4 + 4 + 4)
    with pytest.raises(CacheTrimError, match="quantized at token 20"):
        quantized.trim(1)
    feed(quantized, 5)
    assert quantized.trim(5) == 5 and quantized.offset == 20
    with pytest.raises(CacheTrimError):
        quantized.trim(1)


def test_recurrent_cache_is_never_trimmable() -> None:
    cache = RecurrentCache(2)
    cache.count_tokens(7)
    assert (cache.is_trimmable(), cache.bytes_per_token(), cache.minimum_reusable_offset) == (False, 0, 7)
    assert cache.trim(0) == 0
    with pytest.raises(CacheTrimError, match="recurrent state cannot be trimmed"):
        cache.trim(1)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("llama", ["kv.plain/1"] * 2),
        ("gemma3_text", ["kv.rotating/1", "kv.plain/1"] * 2),
        ("qwen3_next", ["recurrent.arrays/1", "kv.plain/1"] * 2),
    ],
)
def test_make_cache_picks_each_layers_kind_from_the_model(kind: str, expected: list[str]) -> None:
    binding = make_tiny_binding(kind)
    assert [c.signature() for c in make_caches(binding.model)] == expected

"""One codec per cache signature: cache <-> (header entry, named tensors).

Caches are written in the dtype they had in memory and sliced to what they hold; an unknown
signature refuses to persist. Plain and quantized KV are restored into a capacity rounded up to
the 256-token step with at least one free position, so the first decode step writes in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.cache.kv import STEP, PlainKVCache
from mlxkv_inference.cache.rotating import RotatingKVCache
from mlxkv_inference.cache.quantized import QuantizedKVCache
from mlxkv_inference.cache.recurrent import RecurrentCache
from mlxkv_state.errors import CodecMismatchError, UnpersistableCacheError
from mlxkv_state.header import CacheHeaderEntry

CODEC_PROVIDER = "mlxkv-state/1"
_TRIPLE = ("q", "scales", "biases")


@dataclass(frozen=True, slots=True)
class EncodedCache:
    """A header entry (its slots still empty) and the tensors to store, by slot name."""

    entry: CacheHeaderEntry
    tensors: tuple[tuple[str, mx.array], ...]


class CacheCodec(Protocol):
    signature: str

    def encode(self, cache: LayerCache) -> EncodedCache: ...

    def decode(self, entry: CacheHeaderEntry, tensors: Mapping[str, mx.array]) -> LayerCache: ...


def encode_caches(caches: Sequence[LayerCache]) -> list[EncodedCache]:
    """Encode every layer; raises `UnpersistableCacheError` for a cache without a codec."""
    return [_codec_for(cache.signature()).encode(cache) for cache in caches]


def decode_caches(entries: Sequence[CacheHeaderEntry], tensors: Sequence[Mapping[str, mx.array]]) -> list[LayerCache]:
    return [_codec_for(e.signature).decode(e, t) for e, t in zip(entries, tensors, strict=True)]


def restore_capacity(entry: CacheHeaderEntry) -> int | None:
    """Token capacity (axis 2) a reader should allocate for this entry's KV slots, or None.

    Plain and quantized KV restore into ceil((offset + 1) / 256) * 256 so the next token fits in
    place; reading the slots straight into such buffers saves a copy of the whole KV.
    """
    if entry.signature in (PlainCodec.signature, QuantizedCodec.signature) and entry.offset > 0:
        return (entry.offset + STEP) // STEP * STEP
    return None


def _codec_for(signature: str) -> CacheCodec:
    codec = CODECS.get(signature)
    if codec is None:
        raise UnpersistableCacheError(f"no codec for cache signature {signature!r}; known: {', '.join(sorted(CODECS))}")
    return codec


class PlainCodec:
    signature = "kv.plain/1"

    def encode(self, cache: LayerCache) -> EncodedCache:
        assert isinstance(cache, PlainKVCache)
        entry = CacheHeaderEntry(self.signature, cache.offset)
        if cache.keys is None or cache.values is None or cache.offset == 0:
            return EncodedCache(entry, ())
        n = cache.offset
        return EncodedCache(entry, (("keys", cache.keys[..., :n, :]), ("values", cache.values[..., :n, :])))

    def decode(self, entry: CacheHeaderEntry, tensors: Mapping[str, mx.array]) -> LayerCache:
        cache = PlainKVCache()
        if entry.offset > 0:
            keys, values = _take(tensors, entry, "keys", "values")
            cache.keys, cache.values = _with_slack(keys, entry.offset), _with_slack(values, entry.offset)
            cache.offset = entry.offset
        return cache


class RotatingCodec:
    signature = "kv.rotating/1"

    def encode(self, cache: LayerCache) -> EncodedCache:
        assert isinstance(cache, RotatingKVCache)
        entry = CacheHeaderEntry(
            self.signature, cache.offset, trimmable=cache.is_trimmable(),
            ring_index=cache.ring_index, max_size=cache.max_size, keep=cache.keep,
        )
        if cache.keys is None or cache.values is None or cache.offset == 0:
            return EncodedCache(entry, ())
        n = min(cache.keys.shape[2], cache.offset)  # past the offset the buffer holds only zeros
        return EncodedCache(entry, (("keys", cache.keys[..., :n, :]), ("values", cache.values[..., :n, :])))

    def decode(self, entry: CacheHeaderEntry, tensors: Mapping[str, mx.array]) -> LayerCache:
        if entry.max_size is None or entry.keep is None or entry.ring_index is None:
            raise CodecMismatchError("rotating cache entry lacks max_size, keep or ring_index")
        cache = RotatingKVCache(entry.max_size, entry.keep)
        if entry.offset > 0:
            keys, values = _take(tensors, entry, "keys", "values")
            cache.restore_ring(keys, values, entry.offset, entry.ring_index)
        return cache


class QuantizedCodec:
    signature = "kv.quantized/1"

    def encode(self, cache: LayerCache) -> EncodedCache:
        assert isinstance(cache, QuantizedKVCache)
        entry = CacheHeaderEntry(
            self.signature, cache.offset, minimum_reusable_offset=cache.minimum_reusable_offset,
            trimmable=cache.is_trimmable(), bits=cache.bits, group_size=cache.group_size,
        )
        if cache.keys is None or cache.values is None or cache.offset == 0:
            return EncodedCache(entry, ())
        n = cache.offset
        named = [(f"keys.{p}", a[..., :n, :]) for p, a in zip(_TRIPLE, cache.keys)]
        named += [(f"values.{p}", a[..., :n, :]) for p, a in zip(_TRIPLE, cache.values)]
        return EncodedCache(entry, tuple(named))

    def decode(self, entry: CacheHeaderEntry, tensors: Mapping[str, mx.array]) -> LayerCache:
        if entry.bits is None or entry.group_size is None:
            raise CodecMismatchError("quantized cache entry lacks bits or group_size")
        cache = QuantizedKVCache(entry.group_size, entry.bits, converted_at=entry.minimum_reusable_offset)
        if entry.offset > 0:
            k = _take(tensors, entry, *(f"keys.{p}" for p in _TRIPLE))
            v = _take(tensors, entry, *(f"values.{p}" for p in _TRIPLE))
            cache.keys = (_with_slack(k[0], entry.offset), _with_slack(k[1], entry.offset), _with_slack(k[2], entry.offset))
            cache.values = (_with_slack(v[0], entry.offset), _with_slack(v[1], entry.offset), _with_slack(v[2], entry.offset))
            cache.offset = entry.offset
        return cache


class RecurrentCodec:
    signature = "recurrent.arrays/1"

    def encode(self, cache: LayerCache) -> EncodedCache:
        assert isinstance(cache, RecurrentCache)
        entry = CacheHeaderEntry(self.signature, cache.offset, minimum_reusable_offset=cache.offset, trimmable=False)
        if any(s is None for s in cache.cache):
            if any(s is not None for s in cache.cache):
                raise UnpersistableCacheError("recurrent cache is partly empty")
            return EncodedCache(entry, (("size", mx.array(len(cache.cache))),))
        return EncodedCache(entry, tuple((f"state.{i}", s) for i, s in enumerate(cache.cache) if s is not None))

    def decode(self, entry: CacheHeaderEntry, tensors: Mapping[str, mx.array]) -> LayerCache:
        if "size" in tensors:
            size = tensors["size"].item()
            if not isinstance(size, int) or size < 1:
                raise CodecMismatchError(f"recurrent cache size slot holds {size!r}")
            return RecurrentCache(size)
        names = sorted((n for n in tensors if n.startswith("state.")), key=lambda n: int(n.split(".")[1]))
        if not names or names != [f"state.{i}" for i in range(len(names))]:
            raise CodecMismatchError(f"recurrent cache entry has slots {sorted(tensors)}; expected state.0..state.N")
        cache = RecurrentCache(len(names))
        cache.cache = [tensors[n] for n in names]
        cache.offset = entry.offset
        return cache


CODECS: dict[str, CacheCodec] = {c.signature: c for c in (PlainCodec(), RotatingCodec(), QuantizedCodec(), RecurrentCodec())}


def _take(tensors: Mapping[str, mx.array], entry: CacheHeaderEntry, *names: str) -> list[mx.array]:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CodecMismatchError(f"{entry.signature} entry lacks slots {missing}")
    out = [tensors[n] for n in names]
    capacity = restore_capacity(entry) or entry.offset
    for name, t in zip(names, out):
        if t.ndim != 4 or t.shape[2] > max(capacity, entry.offset):
            raise CodecMismatchError(f"slot {name!r} has shape {t.shape}, not (B, heads, <= {capacity}, dim)")
    return out


def _with_slack(t: mx.array, offset: int) -> mx.array:
    """`t` in a buffer of capacity ceil((offset + 1) / STEP) * STEP (read there, or padded here)."""
    capacity = (offset + STEP) // STEP * STEP
    if t.shape[2] == capacity:
        return t
    if t.shape[2] != offset:
        raise CodecMismatchError(f"slot holds {t.shape[2]} tokens; the entry says {offset}")
    pad = mx.zeros((*t.shape[:2], capacity - offset, t.shape[3]), dtype=t.dtype)
    return mx.concatenate([t, pad], axis=2)

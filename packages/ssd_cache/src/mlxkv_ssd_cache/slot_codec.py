"""Slot codecs: how one tensor's bytes are stored (raw, zstd, or byte-shuffle + zstd).

The writer picks per dtype by measurement: it compresses the first slot of each dtype both ways
and keeps the better codec only when it shrinks the slot by `min_gain` (1.3x; float32/float16 KV gains 1.1-1.2x
and decompresses slower than the disk reads, so it stays raw; bfloat16 with the shuffle gains more).
Level 0 stores everything raw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

from mlxkv_ssd_cache.errors import SlotDecodeError


@dataclass(frozen=True, slots=True)
class SlotPolicy:
    level: int = 1
    min_gain: float = 1.3
    threads: int = 2
    codec: str | None = None  # force one codec for every slot (benchmarks); None measures

    def __post_init__(self) -> None:
        if self.codec not in (None, "raw", "zstd", "shuffle+zstd"):
            raise ValueError(f"codec={self.codec!r} is not a slot codec; allowed: raw, zstd, shuffle+zstd")
        if self.codec not in (None, "raw") and self.level == 0:
            raise ValueError(f"codec={self.codec!r} needs a zstd level >= 1")
        if not 0 <= self.level <= 22:
            raise ValueError(f"zstd level={self.level} is out of range; allowed: 0 (raw) to 22")
        if self.min_gain < 1.0:
            raise ValueError(f"min_gain={self.min_gain} must be >= 1.0")
        if self.threads < 1:
            raise ValueError(f"threads={self.threads} must be >= 1")


def encode_slot(data: memoryview, codec: str, level: int, itemsize: int) -> bytes | memoryview:
    if codec == "raw":
        return data
    if codec == "shuffle+zstd":
        data = memoryview(shuffle(data, itemsize))
    return zstandard.ZstdCompressor(level=level).compress(data)


def compressed_size_matches(stored: memoryview, raw_bytes: int) -> bool:
    """Whether the zstd frame declares exactly `raw_bytes` of content (checked before allocating)."""
    try:
        return bool(zstandard.frame_content_size(stored) == raw_bytes)
    except zstandard.ZstdError:
        return False


def decode_slot_into(stored: memoryview, codec: str, itemsize: int, out: memoryview) -> None:
    """Decompress `stored` into `out` (exactly `len(out)` bytes); raises `SlotDecodeError`."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=len(out))
    except zstandard.ZstdError as e:
        raise SlotDecodeError(f"zstd: {e}") from e
    if len(raw) != len(out):
        raise SlotDecodeError(f"slot decompressed to {len(raw)} bytes, expected {len(out)}")
    out[:] = unshuffle(memoryview(raw), itemsize) if codec == "shuffle+zstd" else raw


def choose_codec(sample: memoryview, itemsize: int, policy: SlotPolicy) -> str:
    """The codec worth using for tensors like `sample` (one measured slot of a dtype)."""
    if policy.codec is not None:
        return policy.codec
    if policy.level == 0 or len(sample) == 0:
        return "raw"
    best, best_size = "raw", len(sample) / policy.min_gain
    for codec in ("zstd", "shuffle+zstd") if itemsize > 1 else ("zstd",):
        size = len(encode_slot(sample, codec, policy.level, itemsize))
        if size < best_size:
            best, best_size = codec, size
    return best


def shuffle(data: memoryview, itemsize: int) -> bytes:
    """Group the i-th byte of every element together (Blosc's shuffle): exponents compress."""
    if itemsize == 1:
        return bytes(data)
    return np.frombuffer(data, np.uint8).reshape(-1, itemsize).T.tobytes()


def unshuffle(data: memoryview, itemsize: int) -> bytes:
    if itemsize == 1:
        return bytes(data)
    return np.frombuffer(data, np.uint8).reshape(itemsize, -1).T.tobytes()

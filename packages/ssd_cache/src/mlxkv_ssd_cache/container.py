"""The KV file container (byte layout in ../../FORMAT.md).

    0   8  magic  b"MLXKV\\x00\\r\\n"
    8   4  container version (u32 LE)
    12  4  header length H (u32 LE)
    16  8  xxh3-64 of the header bytes (u64 LE)
    24  H  header: UTF-8 JSON of `KvFileHeader`
    D      data section, D = 24 + H rounded up to 64; slot i at D + slots[i].offset (64-aligned)
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import BinaryIO

import mlx.core as mx
import xxhash

from mlxkv_state.codecs import EncodedCache, restore_capacity
from mlxkv_state.errors import StateError
from mlxkv_state.header import Attachment, CacheHeaderEntry, KvFileHeader, TensorSlot, header_from_json
from mlxkv_ssd_cache._dtypes import SlotBuffer, dtype_from_name, dtype_name, tensor_bytes
from mlxkv_ssd_cache.errors import (
    ChecksumMismatchError, KvFileError, NotAKvFileError, ShortReadError, SlotDecodeError, VersionMismatchError,
)
from mlxkv_ssd_cache.slot_codec import SlotPolicy, choose_codec, compressed_size_matches, decode_slot_into, encode_slot

MAGIC = b"MLXKV\x00\r\n"
CONTAINER_VERSION = 1
_PREFIX = struct.Struct("<8sIIQ")
ALIGN = 64
MAX_HEADER_BYTES = 64 << 20
MAX_SLOT_BYTES = 16 << 30

Tensors = tuple[tuple[str, mx.array], ...]


@dataclass(frozen=True, slots=True)
class EncodedAttachment:
    name: str
    schema: str
    tensors: Tensors


@dataclass(frozen=True, slots=True)
class FileContents:
    """Tensors read back: one name -> tensor map per cache entry, and per attachment."""

    caches: list[dict[str, mx.array]]
    attachments: dict[str, tuple[str, dict[str, mx.array]]]


def write_kv_file(
    out: BinaryIO,
    header: KvFileHeader,
    caches: Sequence[EncodedCache],
    attachments: Sequence[EncodedAttachment] = (),
    policy: SlotPolicy = SlotPolicy(),
) -> KvFileHeader:
    """Write a complete file to `out`; returns the header with its slots filled in."""
    groups: list[Tensors] = [c.tensors for c in caches] + [a.tensors for a in attachments]
    flat = [(name, t) for group in groups for name, t in group]
    raw = [tensor_bytes(t) for _, t in flat]
    codecs = _codecs_by_dtype(flat, raw, policy)
    with ThreadPoolExecutor(policy.threads) as pool:
        stored = list(pool.map(lambda i: encode_slot(raw[i], codecs[flat[i][1].dtype], policy.level, flat[i][1].itemsize), range(len(flat))))
    slots, position = [], 0
    for (name, t), data, blob in zip(flat, raw, stored):
        codec = codecs[t.dtype]
        slots.append(TensorSlot(name, dtype_name(t.dtype), tuple(t.shape), codec, 0 if codec == "raw" else policy.level,
                                position, len(blob), len(data), xxhash.xxh3_64_intdigest(blob)))
        position = _align(position + len(blob))
    header = _with_slots(header, caches, attachments, slots)
    header_bytes = json.dumps(header.to_json(), separators=(",", ":")).encode()
    out.write(_PREFIX.pack(MAGIC, CONTAINER_VERSION, len(header_bytes), xxhash.xxh3_64_intdigest(header_bytes)))
    out.write(header_bytes)
    _pad(out, _PREFIX.size + len(header_bytes))
    for slot, blob in zip(slots, stored):
        out.write(blob)
        _pad(out, slot.stored_bytes)
    return header


def read_kv_header(f: BinaryIO) -> tuple[KvFileHeader, int]:
    """Parse and check the header; returns it and the data section's offset."""
    prefix = f.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise ShortReadError(f"file is {len(prefix)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, length, checksum = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise NotAKvFileError("not an mlxkv KV file (bad magic)")
    if version != CONTAINER_VERSION:
        raise VersionMismatchError(f"container version {version} is not supported (this build reads {CONTAINER_VERSION})")
    if length > MAX_HEADER_BYTES:
        raise KvFileError(f"header length {length} exceeds {MAX_HEADER_BYTES}")
    header_bytes = f.read(length)
    if len(header_bytes) < length:
        raise ShortReadError(f"header is cut at {len(header_bytes)} of {length} bytes")
    if xxhash.xxh3_64_intdigest(header_bytes) != checksum:
        raise ChecksumMismatchError("header checksum mismatch")
    try:
        data = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KvFileError(f"header is not JSON: {e}") from e
    try:
        header = header_from_json(data)
    except StateError as e:
        raise KvFileError(str(e)) from e
    return header, _align(_PREFIX.size + length)


def read_kv_tensors(f: BinaryIO, header: KvFileHeader, data_start: int, file_size: int) -> FileContents:
    """Read, verify and decode every slot; raises a `KvFileError` on any fault.

    KV slots of plain and quantized caches land directly in buffers with room for the next
    tokens (`restore_capacity`), so restoring copies the KV once, from the file.
    """
    available = file_size - data_start
    for c in header.caches:  # their buffers are sized from the offset: a corrupt one could ask for any size
        if restore_capacity(c) is not None and any(len(s.shape) == 4 and s.shape[2] != c.offset for s in c.slots):
            raise SlotDecodeError(f"a {c.signature} cache of {c.offset} positions stores slots of another length")
    caches = [_read_group(f, c.slots, data_start, available, restore_capacity(c)) for c in header.caches]
    attachments = {a.name: (a.schema, _read_group(f, a.slots, data_start, available, None)) for a in header.attachments}
    return FileContents(caches, attachments)


def _read_group(f: BinaryIO, slots: Sequence[TensorSlot], data_start: int, available: int, capacity: int | None) -> dict[str, mx.array]:
    return {slot.name: _read_slot(f, slot, data_start, available, capacity) for slot in slots}


def _read_slot(f: BinaryIO, slot: TensorSlot, data_start: int, available: int, capacity: int | None) -> mx.array:
    dtype = dtype_from_name(slot.dtype)
    if dtype is None:
        raise SlotDecodeError(f"slot {slot.name!r} has unknown dtype {slot.dtype!r}")
    if slot.raw_bytes != math.prod(slot.shape) * dtype.size:
        raise SlotDecodeError(f"slot {slot.name!r}: {slot.raw_bytes} bytes cannot hold {slot.dtype}{list(slot.shape)}")
    if slot.offset + slot.stored_bytes > available:
        raise ShortReadError(f"slot {slot.name!r} ends past the end of the file (truncated)")
    if slot.codec == "raw" and slot.stored_bytes != slot.raw_bytes:
        raise SlotDecodeError(f"raw slot {slot.name!r} stores {slot.stored_bytes} of {slot.raw_bytes} bytes")
    f.seek(data_start + slot.offset)
    layout = _Layout.of(slot, dtype.size, capacity)
    buffer = SlotBuffer(layout.buffer_bytes)
    if slot.codec == "raw":  # read straight into MLX memory, row block by row block
        digest = xxhash.xxh3_64()
        for start, end in layout.rows():
            chunk = buffer.view[start:end]
            if f.readinto(chunk) != end - start:  # type: ignore[attr-defined]
                raise ShortReadError(f"slot {slot.name!r} is cut short")
            digest.update(chunk)
        _check(digest.intdigest(), slot)
        return buffer.tensor(dtype, layout.shape)
    stored = memoryview(bytearray(slot.stored_bytes))
    if f.readinto(stored) != slot.stored_bytes:  # type: ignore[attr-defined]
        raise ShortReadError(f"slot {slot.name!r} is cut short")
    _check(xxhash.xxh3_64_intdigest(stored), slot)
    if slot.raw_bytes > MAX_SLOT_BYTES or not compressed_size_matches(stored, slot.raw_bytes):
        raise SlotDecodeError(f"slot {slot.name!r}: compressed frame does not declare {slot.raw_bytes} bytes")
    raw = memoryview(bytearray(slot.raw_bytes)) if layout.padded else buffer.view
    decode_slot_into(stored, slot.codec, dtype.size, raw)
    at = 0
    for start, end in layout.rows():
        buffer.view[start:end] = raw[at : at + end - start]
        at += end - start
    return buffer.tensor(dtype, layout.shape)


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a slot's bytes go: contiguous, or (B, H, T, D) rows spread over a T-capacity buffer."""

    shape: tuple[int, ...]
    row_bytes: int  # bytes of one (b, h) block in the file
    row_stride: int  # bytes between (b, h) blocks in the buffer
    rows_count: int

    @classmethod
    def of(cls, slot: TensorSlot, itemsize: int, capacity: int | None) -> _Layout:
        if capacity is None or len(slot.shape) != 4 or capacity <= slot.shape[2]:
            return cls(slot.shape, slot.raw_bytes, slot.raw_bytes, 1)
        b, h, t, d = slot.shape
        return cls((b, h, capacity, d), t * d * itemsize, capacity * d * itemsize, b * h)

    @property
    def buffer_bytes(self) -> int:
        return self.row_stride * self.rows_count

    @property
    def padded(self) -> bool:
        return self.row_stride != self.row_bytes

    def rows(self) -> list[tuple[int, int]]:
        return [(i * self.row_stride, i * self.row_stride + self.row_bytes) for i in range(self.rows_count)]


def _check(digest: int, slot: TensorSlot) -> None:
    if digest != slot.checksum:
        raise ChecksumMismatchError(f"slot {slot.name!r} checksum mismatch")


def _codecs_by_dtype(flat: Sequence[tuple[str, mx.array]], raw: Sequence[memoryview], policy: SlotPolicy) -> dict[mx.Dtype, str]:
    codecs: dict[mx.Dtype, str] = {}
    for (_, t), data in zip(flat, raw):
        if t.dtype not in codecs:
            codecs[t.dtype] = choose_codec(data, t.itemsize, policy)
    return codecs


def _with_slots(
    header: KvFileHeader, caches: Sequence[EncodedCache], attachments: Sequence[EncodedAttachment], slots: list[TensorSlot]
) -> KvFileHeader:
    it = iter(slots)
    entries: list[CacheHeaderEntry] = [replace(c.entry, slots=tuple(next(it) for _ in c.tensors)) for c in caches]
    atts = [Attachment(a.name, a.schema, tuple(next(it) for _ in a.tensors)) for a in attachments]
    return replace(header, caches=tuple(entries), attachments=tuple(atts))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pad(out: BinaryIO, written: int) -> None:
    out.write(b"\0" * (_align(written) - written))


def file_size(f: BinaryIO) -> int:
    return os.fstat(f.fileno()).st_size


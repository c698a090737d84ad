"""A GGUF file's metadata and raw tensors, read straight from a memory map.

The values are those of the `gguf` package's reader (llama.cpp's): `metadata` holds what its
`ReaderField.contents()` returns (str, int, float, bool, flat lists), and each tensor's `data` is
the array its `ReaderTensor.data` is (the same dtype and shape, a view of the file). That reader
builds a numpy view per value, some 20 s for a 262,144-piece vocabulary; this one walks a string
array in one loop (decoding it in another, only when asked) and reads a number array with one
`np.frombuffer`.

    magic "GGUF" | version u32 | tensor count u64 | kv count u64
    kv:     key string | value type u32 | value       (string = length u64 + UTF-8 bytes)
    tensor: name string | dims u32 | dim u64 x dims | type u32 | offset u64
    padding to `general.alignment` (32) | tensor data (each at its offset from here)

Little-endian files of versions 2 and 3 only: `NotReadHere` sends any other to the `gguf` reader.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from mlxkv_inference.errors import ModelLoadError

__all__ = ["GgufFile", "GgufTensor", "NotReadHere", "UnreadStrings", "read_gguf_file"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_V = GGUFValueType
_SCALARS: dict[int, np.dtype[Any]] = {
    int(t): np.dtype(code) for t, code in (
        (_V.UINT8, "<u1"), (_V.INT8, "<i1"), (_V.UINT16, "<u2"), (_V.INT16, "<i2"), (_V.UINT32, "<u4"),
        (_V.INT32, "<i4"), (_V.FLOAT32, "<f4"), (_V.UINT64, "<u8"), (_V.INT64, "<i8"), (_V.FLOAT64, "<f8"),
        (_V.BOOL, "?"),
    )
}
_T = GGMLQuantizationType
# Tensor types the `gguf` reader gives as typed elements; every other type comes as raw block bytes.
_ELEMENT_DTYPES = {_T.F16: "<f2", _T.F32: "<f4", _T.F64: "<f8", _T.I8: "<i1", _T.I16: "<i2", _T.I32: "<i4", _T.I64: "<i8"}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class NotReadHere(Exception):
    """A GGUF file this reader leaves to the `gguf` package's: big-endian, or another version."""


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]  # elements, numpy order
    data: np.ndarray  # elements (F16, F32, ...) or block bytes (uint8), numpy order: innermost axis last


@dataclass(frozen=True, slots=True)
class UnreadStrings:
    """A string array left unread (`read_gguf_file(..., strings=False)`): its bytes, as the file
    holds them (each string a u64 length, then UTF-8), bounds already checked."""

    raw: memoryview
    count: int

    def read(self) -> list[str]:
        """Raises UnicodeDecodeError for bytes that are not UTF-8."""
        # bytes slices decode faster than memoryview slices; the bounds were checked when walked
        raw, at, out = bytes(self.raw), 0, []
        unpack = _U64.unpack_from
        for _ in range(self.count):
            end = at + 8 + unpack(raw, at)[0]
            out.append(raw[at + 8 : end].decode())
            at = end
        return out


@dataclass(frozen=True, slots=True)
class GgufFile:
    path: Path
    metadata: dict[str, Any]  # string arrays as UnreadStrings where read with strings=False
    tensors: tuple[GgufTensor, ...]

    def with_strings(self) -> GgufFile:
        """This file with its string arrays read; raises ModelLoadError for one that is not UTF-8."""
        try:
            metadata = {k: v.read() if isinstance(v, UnreadStrings) else v for k, v in self.metadata.items()}
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {type(e).__name__}: {e}") from e
        return GgufFile(self.path, metadata, self.tensors)


def read_gguf_file(path: Path, *, strings: bool = True) -> GgufFile:
    """Raises ModelLoadError for a file that is not a well-formed GGUF file (truncated, corrupt),
    NotReadHere for one the `gguf` reader should read instead. `strings=False` leaves the string
    arrays (a vocabulary, its merges) unread: what a caller needing only the tensor types wants."""
    try:
        data = np.memmap(path, mode="r")
    except (OSError, ValueError) as e:  # missing, unreadable, empty
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    try:
        metadata, tensors = _Parser(data).file()
    except ModelLoadError as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e
    file = GgufFile(path, metadata, tensors)
    return file.with_strings() if strings else file


class _Parser:
    """A cursor over the mapped bytes; every read checks that the file holds it."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.view = data.data
        self.size = len(data)
        self.at = 0

    def file(self) -> tuple[dict[str, Any], tuple[GgufTensor, ...]]:
        if bytes(self.take(4)) != _MAGIC:
            raise ModelLoadError("not a GGUF file (bad magic)")
        version = self.u32()
        if version not in _VERSIONS:
            raise NotReadHere(f"GGUF version {version:#x}")
        tensor_count, kv_count = self.u64(), self.u64()
        metadata: dict[str, Any] = {}
        alignment = _DEFAULT_ALIGNMENT
        for _ in range(kv_count):
            key, kind = self.string(), self.u32()
            if key in metadata:
                raise ModelLoadError(f"GGUF metadata key {key!r} appears twice")
            metadata[key] = self.value(kind)
            if key == "general.alignment":
                alignment = _alignment(kind, metadata[key])
        infos = [self.tensor_info() for _ in range(tensor_count)]
        start = -(-self.at // alignment) * alignment
        return {k: v for k, v in metadata.items() if not k.startswith("GGUF.")}, self.tensors(infos, start)

    def take(self, n: int) -> memoryview:
        end = self.at + n
        if end > self.size:
            raise ModelLoadError(f"truncated GGUF file: {n} bytes wanted at offset {self.at}, the file ends at {self.size}")
        out = self.view[self.at : end]
        self.at = end
        return out

    def u32(self) -> int:
        value: int = _U32.unpack(self.take(4))[0]
        return value

    def u64(self) -> int:
        value: int = _U64.unpack(self.take(8))[0]
        return value

    def string(self) -> str:
        return str(self.take(self.u64()), "utf-8")

    def value(self, kind: int) -> Any:
        if kind == _V.STRING:
            return self.string()
        if kind in _SCALARS:
            return self.numbers(kind, 1)[0]
        if kind == _V.ARRAY:
            item, count = self.u32(), self.u64()
            if item == _V.STRING:
                return self.strings(count)
            if item in _SCALARS:
                return self.numbers(item, count)
            return [v for _ in range(count) for v in _flat(self.value(item))]  # arrays of arrays: flat, as gguf has them
        raise ModelLoadError(f"GGUF value type {kind} is unknown")

    def numbers(self, kind: int, count: int) -> list[Any]:
        dtype = _SCALARS[kind]
        out: list[Any] = np.frombuffer(self.take(dtype.itemsize * count), dtype=dtype).tolist()
        return out

    def strings(self, count: int) -> UnreadStrings:
        # The hot loop of a vocabulary: walked here (one bounds check per piece), decoded later.
        view, size, start = self.view, self.size, self.at
        at = start
        unpack = _U64.unpack_from
        for _ in range(count):
            if at + 8 > size or (at := at + 8 + unpack(view, at)[0]) > size:
                raise ModelLoadError(f"truncated GGUF file: a string array runs past the end ({size} bytes)")
        self.at = at
        return UnreadStrings(view[start:at], count)

    def tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self.string()
        dims = [self.u64() for _ in range(self.u32())]
        return name, dims, self.u32(), self.u64()

    def tensors(self, infos: list[tuple[str, list[int], int, int]], start: int) -> tuple[GgufTensor, ...]:
        out: list[GgufTensor] = []
        seen: set[str] = set()
        for name, dims, raw_kind, offset in infos:
            if name in seen:
                raise ModelLoadError(f"GGUF tensor {name!r} appears twice")
            seen.add(name)
            kind = GGMLQuantizationType(raw_kind)  # ValueError for an unknown type
            shape = tuple(reversed(dims))
            out.append(GgufTensor(name, kind, shape, self.tensor_data(name, kind, shape, start + offset)))
        return tuple(out)

    def tensor_data(self, name: str, kind: GGMLQuantizationType, shape: tuple[int, ...], at: int) -> np.ndarray:
        elements = math.prod(shape)
        if kind in _ELEMENT_DTYPES:
            dtype, count = np.dtype(_ELEMENT_DTYPES[kind]), elements
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            dtype, count, shape = np.dtype(np.uint8), elements * type_size // block_size, quant_shape_to_byte_shape(shape, kind)
        end = at + count * dtype.itemsize
        if end > self.size:
            raise ModelLoadError(f"truncated GGUF file: tensor {name!r} ends at {end}, the file at {self.size}")
        return self.data[at:end].view(dtype).reshape(shape)


def _alignment(kind: int, value: Any) -> int:
    if kind != _V.UINT32 or value <= 0 or value & (value - 1):
        raise ModelLoadError(f"GGUF general.alignment must be a power of two (uint32), got {value!r}")
    return int(value)


def _flat(value: Any) -> list[Any]:
    if isinstance(value, UnreadStrings):
        return value.read()
    return value if isinstance(value, list) else [value]

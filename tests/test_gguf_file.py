"""`gguf_file` reads what the `gguf` package's reader (llama.cpp's) reads: the same metadata values
and types, the same tensor arrays. Small files written by `gguf.GGUFWriter`, and the embedded model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFValueType as V

from mlxkv_inference.errors import ModelLoadError
from mlxkv_inference.models.embedded import embedded_model_path
from mlxkv_inference.models.gguf_file import GgufFile, NotReadHere, UnreadStrings, read_gguf_file
from mlxkv_inference.models.gguf_reader import read_gguf
from tests.test_gguf_quants import random_blocks

# One value of every GGUF type, and arrays of them (strings with multi-byte UTF-8, arrays of arrays).
VALUES: list[tuple[str, Any, V, V | None]] = [
    ("t.u8", 200, V.UINT8, None), ("t.i8", -100, V.INT8, None), ("t.u16", 60000, V.UINT16, None),
    ("t.i16", -30000, V.INT16, None), ("t.u32", 4_000_000_000, V.UINT32, None), ("t.i32", -2_000_000_000, V.INT32, None),
    ("t.f32", 0.1, V.FLOAT32, None), ("t.u64", 2**63 + 5, V.UINT64, None), ("t.i64", -(2**62), V.INT64, None),
    ("t.f64", 0.1, V.FLOAT64, None), ("t.bool", True, V.BOOL, None), ("t.str", "naïve 日本 🙂", V.STRING, None),
    ("t.strs", ["a", "", "▁the", "<0x0A>", "🙂🙂"], V.ARRAY, V.STRING), ("t.f32s", [-1.5, 3e-7, 0.1], V.ARRAY, V.FLOAT32),
    ("t.i32s", [1, -2, 3], V.ARRAY, V.INT32), ("t.bools", [True, False], V.ARRAY, V.BOOL),
    ("t.nested", [[1, 2], [3]], V.ARRAY, V.ARRAY),
]


def write_file(path: Path, big_endian: bool = False, int_tensor: bool = True) -> Path:
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    for key, value, kind, sub in VALUES:
        writer.add_key_value(key, value, kind, sub)
    rng = np.random.default_rng(0)
    floats = rng.normal(0, 1, (3, 64)).astype(np.float32)
    tensors: list[tuple[str, np.ndarray, T]] = [
        ("output_norm.weight", floats[0], T.F32), ("blk.0.attn_q.weight", floats.astype(np.float16), T.F16),
        ("blk.0.ffn_up.weight", random_blocks(T.Q4_K, 2, 256), T.Q4_K), ("blk.0.ffn_down.weight", random_blocks(T.Q8_0, 3, 64), T.Q8_0),
        ("blk.0.ffn_gate.weight", random_blocks(T.Q6_K, 1, 256), T.Q6_K),
    ]
    if int_tensor:  # a type gguf's reader gives as elements, which mlxkv does not load
        tensors.append(("token_embd.weight", floats.view(np.int32), T.I32))
    for name, data, tensor_type in tensors:
        writer.add_tensor(name, data, raw_dtype=tensor_type)  # the writer swaps bytes for a big-endian file
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_reads_like_gguf(file: GgufFile, reader: gguf.GGUFReader) -> None:
    expected = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert list(file.metadata) == list(expected)
    for key, value in expected.items():
        got = file.metadata[key]
        assert got == value and type(got) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in got] == [type(v) for v in value], key
    assert [(t.name, t.kind) for t in file.tensors] == [(t.name, t.tensor_type) for t in reader.tensors]
    for ours, theirs in zip(file.tensors, reader.tensors, strict=True):
        assert ours.shape == tuple(int(n) for n in reversed(theirs.shape)), ours.name
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        assert np.array_equal(ours.data, theirs.data), ours.name


def test_every_value_and_tensor_type_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    path = write_file(tmp_path / "all.gguf")
    file = read_gguf_file(path)
    assert_reads_like_gguf(file, gguf.GGUFReader(path))
    assert file.metadata["t.nested"] == [1, 2, 3]  # arrays of arrays come flat, as gguf gives them
    assert file.metadata["t.f32"] == float(np.float32(0.1)) and file.metadata["t.u64"] == 2**63 + 5


def test_string_arrays_left_unread_read_the_same_later(tmp_path: Path) -> None:
    path = write_file(tmp_path / "all.gguf")
    lazy = read_gguf_file(path, strings=False)
    assert isinstance(lazy.metadata["t.strs"], UnreadStrings) and lazy.metadata["t.str"] == "naïve 日本 🙂"
    assert lazy.with_strings().metadata == read_gguf_file(path).metadata


def test_a_string_that_is_not_utf8_is_a_load_error(tmp_path: Path) -> None:
    path = write_file(tmp_path / "all.gguf", int_tensor=False)
    data = bytearray(path.read_bytes())
    data[data.index("🙂🙂".encode())] = 0xFF  # in the string array t.strs
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="UnicodeDecodeError"):
        read_gguf_file(path)
    with pytest.raises(ModelLoadError, match="UnicodeDecodeError"):
        read_gguf(path)  # its tensor types are not all MLX's: the strings are read


def test_embedded_model_reads_as_gguf_reads_it() -> None:
    assert_reads_like_gguf(read_gguf_file(embedded_model_path()), gguf.GGUFReader(embedded_model_path()))


def test_a_file_cut_anywhere_is_a_load_error_or_lost_only_padding(tmp_path: Path) -> None:
    path = write_file(tmp_path / "all.gguf")
    data = path.read_bytes()
    whole = read_gguf_file(path)
    cut = tmp_path / "cut.gguf"
    header = data.index(whole.tensors[0].data.tobytes())  # every byte of the header, then steps through the tensors
    for size in [*range(header + 1), *range(header + 1, len(data), 7)]:
        cut.write_bytes(data[:size])
        try:
            file = read_gguf_file(cut)
        except ModelLoadError:
            continue
        # Only the padding after the last tensor may go: everything read must still be there.
        assert size >= len(data) - 32 and file.metadata == whole.metadata, size
        assert all(np.array_equal(a.data, b.data) for a, b in zip(file.tensors, whole.tensors, strict=True)), size


def test_a_big_endian_file_is_left_to_gguf_s_reader(tmp_path: Path) -> None:
    path = write_file(tmp_path / "be.gguf", big_endian=True, int_tensor=False)
    with pytest.raises(NotReadHere):
        read_gguf_file(path)
    _, metadata = read_gguf(path)  # read through the gguf package's reader
    assert metadata["t.strs"] == ["a", "", "▁the", "<0x0A>", "🙂🙂"] and metadata["t.i64"] == -(2**62)


@pytest.mark.parametrize("patch", ["magic", "alignment", "duplicate key", "tensor type"])
def test_a_corrupt_header_is_a_load_error(patch: str, tmp_path: Path) -> None:
    path = write_file(tmp_path / "all.gguf")
    data = bytearray(path.read_bytes())
    if patch == "magic":
        data[:4] = b"GGUG"
    elif patch == "alignment":  # t.u32 becomes general.alignment = 4,000,000,000: not a power of two
        at = data.index(b"t.u32")
        data[at - 8 : at + 5] = len(b"general.alignment").to_bytes(8, "little") + b"general.alignment"
    elif patch == "duplicate key":
        at = data.index(b"t.i16")
        data[at : at + 5] = b"t.u16"
    else:
        at = data.index(b"output_norm.weight") + len("output_norm.weight") + 4 + 8  # name, dims (1), dim
        data[at : at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=f"cannot read GGUF file {re.escape(str(path))}"):
        read_gguf_file(path)

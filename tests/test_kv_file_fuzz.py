"""Property test: random and mutated files make the reader raise only our own errors."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.cache.recurrent import RecurrentCache
from mlxkv_ssd_cache import KvIdentity, read_file, write_file_atomically
from mlxkv_ssd_cache.kv_file import build_header
from mlxkv_state.errors import StateError
from tests.factories import make_plain_caches

import mlx.core as mx

_WORK_DIR = tempfile.TemporaryDirectory(prefix="mlxkv-fuzz-")  # removed when the test process exits
_WORK = Path(_WORK_DIR.name)


def _valid_file() -> bytes:
    path = _WORK / "valid.mlxkv"
    recurrent = RecurrentCache(2)
    recurrent.cache = [mx.ones((1, 3, 8)), mx.zeros((1, 2, 4, 4))]
    recurrent.offset = 5
    caches: list[PlainKVCache | RecurrentCache] = [*make_plain_caches(5, layers=1), recurrent, PlainKVCache()]
    write_file_atomically(path, build_header(KvIdentity("m", "t", "f"), list(range(5)), "", None), caches)
    return path.read_bytes()


VALID = _valid_file()


def read_raises_only_our_errors(blob: bytes) -> None:
    path = _WORK / "fuzzed.mlxkv"
    path.write_bytes(blob)
    try:
        read_file(path)
    except StateError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_random_bytes(blob: bytes) -> None:
    read_raises_only_our_errors(blob)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8), st.integers(0, len(VALID)))
def test_mutated_valid_file(edits: list[tuple[int, int]], cut: int) -> None:
    blob = bytearray(VALID)
    for at, value in edits:
        blob[at] = value
    read_raises_only_our_errors(bytes(blob[:cut]))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([b"MLXKV\x00\r\n"]), st.binary(max_size=64), st.binary(max_size=512))
def test_valid_magic_with_garbage_after(magic: bytes, prefix: bytes, rest: bytes) -> None:
    read_raises_only_our_errors(magic + prefix + rest)


def _reframe(header: object, data: bytes) -> bytes:
    """A file whose header is `header` with a correct checksum: the parser itself is exercised."""
    import json
    import struct

    import xxhash

    body = json.dumps(header).encode()
    prefix = struct.pack("<8sIIQ", b"MLXKV\x00\r\n", 1, len(body), xxhash.xxh3_64_intdigest(body)) + body
    return prefix + b"\0" * (-len(prefix) % 64) + data


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checksummed_header_with_mutated_fields(data: st.DataObject) -> None:
    import json

    from mlxkv_ssd_cache.container import read_kv_header

    with (_WORK / "valid.mlxkv").open("rb") as f:
        header, start = read_kv_header(f)
    doc = json.loads(json.dumps(header.to_json()))
    cache, slot = doc["caches"][0], doc["caches"][0]["slots"][0]
    places = [(doc, k) for k in doc] + [(cache, k) for k in cache] + [(slot, k) for k in slot]
    for target, key in data.draw(st.lists(st.sampled_from(places), min_size=1, max_size=3)):
        target[key] = data.draw(JSON_VALUES)
    read_raises_only_our_errors(_reframe(doc, VALID[start:]))


@pytest.mark.parametrize("offset", [4, 6, 8388352])
def test_a_cache_offset_its_slots_do_not_hold_is_refused_before_its_buffer_is_sized(offset: int) -> None:
    """Found by the test above: the slots are read into buffers sized from the cache's offset, and
    an offset of 8,388,352 asked MLX for an array larger than it can index (an OverflowError,
    not a cache miss)."""
    import json

    from mlxkv_ssd_cache.container import read_kv_header

    with (_WORK / "valid.mlxkv").open("rb") as f:
        header, start = read_kv_header(f)
    doc = json.loads(json.dumps(header.to_json()))
    assert doc["caches"][0]["offset"] == 5 and offset != 5
    doc["caches"][0]["offset"] = offset
    path = _WORK / "offset.mlxkv"
    path.write_bytes(_reframe(doc, VALID[start:]))
    with pytest.raises(StateError, match="stores slots of another length"):
        read_file(path)

"""KV identity: the weights digest covers every byte, and identities never share entry files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv_inference import MlxAutoregressiveBinding, load_binding
from mlxkv_inference.models.embedded import embedded_model_path
from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.models.weights_digest import weights_digest
from mlxkv_ssd_cache import SsdCacheStore
from tests.factories import make_identity, make_plain_caches


def flip_middle_byte(path: Path) -> None:
    """Change one byte in the middle of `path` in place (same size, same inode)."""
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.fixture(scope="module")
def embedded_copy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-copies")


def test_embedded_gguf_with_one_byte_changed_in_the_middle_gets_another_fingerprint(
    embedded: MlxAutoregressiveBinding, embedded_copy_dir: Path
) -> None:
    original = embedded_model_path()
    changed = embedded_copy_dir / "changed" / original.name  # same file name, size, first and last MiB
    changed.parent.mkdir()
    shutil.copyfile(original, changed)
    flip_middle_byte(changed)
    assert weights_digest([changed]) != weights_digest([original])
    assert load_binding(changed).config_fingerprint != embedded.config_fingerprint


def test_weights_digest_memo_is_keyed_by_path_size_mtime_and_inode(tmp_path: Path) -> None:
    weights, memo = tmp_path / "model.safetensors", tmp_path / "memo" / "digests.json"
    weights.write_bytes(bytes(range(256)) * 4096)
    first = weights_digest([weights], memo)
    assert first == weights_digest([weights])  # the memo only remembers; it never changes a digest
    stamp = weights.stat()
    flip_middle_byte(weights)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # same path, size, mtime, inode
    changed = weights_digest([weights])
    assert changed != first
    assert weights_digest([weights], memo) == first  # served from the memo: the file was not re-read
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1))
    assert weights_digest([weights], memo) == changed  # a new mtime is a new stamp: read again
    assert weights_digest([weights], memo) == changed


def test_corrupt_weights_digest_memo_is_ignored_and_rewritten(tmp_path: Path) -> None:
    weights, memo = tmp_path / "model.gguf", tmp_path / "digests.json"
    weights.write_bytes(b"weights" * 1000)
    memo.write_text('{"version": 1, "files": {"' + str(weights) + '": [1, 2')
    assert weights_digest([weights], memo) == weights_digest([weights])
    entries = json.loads(memo.read_text())["files"]
    assert list(entries) == [str(weights.resolve())]
    assert entries[str(weights.resolve())]["size"] == 7000


def test_byte_identical_gguf_copy_under_another_name_keeps_its_own_entries(
    embedded: MlxAutoregressiveBinding, embedded_copy_dir: Path, tmp_path: Path
) -> None:
    twin_path = embedded_copy_dir / "twin" / "SmolLM2-twin.gguf"
    twin_path.parent.mkdir()
    shutil.copyfile(embedded_model_path(), twin_path)
    twin = load_binding(twin_path)
    assert twin.model_id != embedded.model_id and twin.config_fingerprint == embedded.config_fingerprint
    prompt = embedded.tokenizer.encode("The capital of France is")
    for seed, binding in enumerate((embedded, twin)):
        assert SsdCacheStore(tmp_path, make_identity(binding), 1 << 30).store(prompt, make_plain_caches(len(prompt), seed=seed))
    assert len(list(tmp_path.rglob("*.mlxkv"))) == 2
    for seed, binding in enumerate((embedded, twin)):
        store = SsdCacheStore(tmp_path, make_identity(binding), 1 << 30)  # a restart of each model
        hit = store.find(prompt + [1])
        restored = store.restore(hit) if hit is not None else None
        assert restored is not None and restored.tokens == tuple(prompt)
        (mine, *_), (want, *_) = restored.caches, make_plain_caches(len(prompt), seed=seed)
        assert isinstance(mine, PlainKVCache) and mine.keys is not None and want.keys is not None
        assert mx.array_equal(mine.keys[..., : len(prompt), :], want.keys[..., : len(prompt), :]).item()

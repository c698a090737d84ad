"""KV persistence end to end: persist mid-generation, restore in a fresh process, continue
exactly; re-saving is stable; identities never cross."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlxkv_inference import Generation, GenerationParams, KvScheme, MlxAutoregressiveBinding
from mlxkv_ssd_cache import KvIdentity, SsdCacheStore, read_file, read_header, write_file_atomically
from mlxkv_ssd_cache.kv_file import build_header
from tests.factories import make_identity, make_plain_caches, make_prompt, make_tiny_binding
from tests.fork_restore import binding_for

SPECS: list[dict[str, Any]] = [
    {"kind": "llama"},
    {"kind": "gemma3_text"},  # sliding window 8: wrapped long before the split point
    {"kind": "qwen3_next"},  # recurrent + plain
    {"kind": "llama", "kv_scheme": {"bits": 4, "group_size": 32, "quantized_start": 10}, "overrides": {"head_dim": 64}},
    {"kind": "llama", "kv_scheme": {"bits": 8, "group_size": 32, "quantized_start": 10}, "overrides": {"head_dim": 64}},
]
IDS = ["plain", "rotating", "recurrent", "quantized4", "quantized8"]


def persist_mid_generation(binding: MlxAutoregressiveBinding, prompt: list[int], directory: Path, split: int, tail: int) -> tuple[list[int], list[int]]:
    """Generate `split` tokens, store the caches, continue in memory; returns (resume prompt, continuation)."""
    generation = Generation(binding, prompt, GenerationParams(max_tokens=split, ignore_eos=True))
    first = list(generation.run().token_ids)
    covered = prompt + first[:-1]  # the loop leaves the last sampled token unfed
    assert all(c.offset == len(covered) for c in generation.caches)
    store = SsdCacheStore(directory, make_identity(binding), 1 << 30)
    assert store.store(covered, generation.caches)
    resume = covered + first[-1:]
    params = GenerationParams(max_tokens=tail, ignore_eos=True)
    continuation = Generation(binding, resume, params, caches=generation.caches).run().token_ids
    return resume, list(continuation)


def run_fresh_process(spec: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "tests.fork_restore", json.dumps(spec)],
                          capture_output=True, text=True, check=True, timeout=300)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_restored_cache_continues_exactly_in_a_fresh_process(spec: dict[str, Any], tmp_path: Path) -> None:
    binding = binding_for(spec)
    resume, expected = persist_mid_generation(binding, make_prompt(20), tmp_path, split=12, tail=24)
    result = run_fresh_process({**spec, "directory": str(tmp_path), "prompt": resume, "max_tokens": 24})
    assert result == {"cached": len(resume) - 1, "tokens": expected}


def test_embedded_restored_cache_continues_exactly_in_a_fresh_process(embedded: MlxAutoregressiveBinding, tmp_path: Path) -> None:
    prompt = embedded.tokenizer.encode("The three primary colors are")
    resume, expected = persist_mid_generation(embedded, prompt, tmp_path, split=6, tail=10)
    result = run_fresh_process({"kind": "embedded", "directory": str(tmp_path), "prompt": resume, "max_tokens": 10})
    assert result == {"cached": len(resume) - 1, "tokens": expected}


def slot_checksums(path: Path) -> list[tuple[str, int]]:
    header, _ = read_header(path)
    return [(s.name, s.checksum) for c in header.caches for s in c.slots]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_save_restore_save_gives_identical_slot_checksums(spec: dict[str, Any], tmp_path: Path) -> None:
    binding = binding_for(spec)
    generation = Generation(binding, make_prompt(20), GenerationParams(max_tokens=8, ignore_eos=True))
    generation.run()
    identity = make_identity(binding)
    tokens = list(range(generation.caches[0].offset))
    first, second = tmp_path / "a.mlxkv", tmp_path / "b.mlxkv"
    write_file_atomically(first, build_header(identity, tokens, "", None), generation.caches)
    _, restored, _ = read_file(first)
    write_file_atomically(second, build_header(identity, tokens, "", None), restored)
    assert slot_checksums(first) == slot_checksums(second)
    assert len(slot_checksums(first)) >= len(generation.caches)


IDENTITY = KvIdentity("model-a", "tok-a", "fp-a")


def stored_entry(directory: Path, identity: KvIdentity = IDENTITY, ns: str = "") -> list[int]:
    tokens = list(range(40))
    store = SsdCacheStore(directory, identity, 1 << 30)
    assert store.store(tokens, make_plain_caches(40), ns=ns)
    return tokens


@pytest.mark.parametrize(
    "other",
    [KvIdentity("model-b", "tok-a", "fp-a"), KvIdentity("model-a", "tok-b", "fp-a"), KvIdentity("model-a", "tok-a", "fp-b")],
    ids=["model id", "tokenizer hash", "config fingerprint"],
)
def test_file_of_another_identity_is_never_restored(other: KvIdentity, tmp_path: Path) -> None:
    tokens = stored_entry(tmp_path)
    store = SsdCacheStore(tmp_path, other, 1 << 30)
    assert store.find(tokens + [1]) is None
    assert store.stats().entries == 0
    assert len(list(tmp_path.rglob("*.mlxkv"))) == 1  # skipped, never deleted


def test_file_of_another_namespace_is_never_restored(tmp_path: Path) -> None:
    tokens = stored_entry(tmp_path, ns="adapter-a")
    store = SsdCacheStore(tmp_path, IDENTITY, 1 << 30)
    assert store.find(tokens + [1], ns="adapter-b") is None
    assert store.find(tokens + [1], ns="") is None
    assert store.find(tokens + [1], ns="adapter-a") is not None


def test_file_moved_under_another_identity_is_not_restored(tmp_path: Path) -> None:
    tokens = stored_entry(tmp_path)
    source = next(tmp_path.rglob("*.mlxkv"))
    forged = KvIdentity("model-a", "tok-a", "fp-z")
    target = tmp_path / "fp-z" / "base"
    target.mkdir(parents=True)
    source.rename(target / source.name)
    store = SsdCacheStore(tmp_path, forged, 1 << 30)
    assert store.find(tokens + [1]) is None


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("codec", ["raw", "zstd", "shuffle+zstd"])
def test_every_slot_codec_round_trips_every_dtype_exactly(dtype_name: str, codec: str, tmp_path: Path) -> None:
    import mlx.core as mx

    from mlxkv_inference.cache.kv import PlainKVCache
    from mlxkv_ssd_cache import SlotPolicy

    dtype = getattr(mx, dtype_name)
    caches: list[PlainKVCache] = make_plain_caches(64, dtype=dtype)
    path = tmp_path / "x.mlxkv"
    policy = SlotPolicy(level=0 if codec == "raw" else 1, codec=codec)
    written = write_file_atomically(path, build_header(IDENTITY, list(range(64)), "", None), caches, policy=policy)
    assert {s.codec for c in written.caches for s in c.slots} == {codec}
    _, restored, _ = read_file(path)
    for a, b in zip(caches, restored):
        assert isinstance(b, PlainKVCache) and a.keys is not None and b.keys is not None
        assert b.keys.dtype == dtype and b.keys.shape[2] == 256  # restored with room for the next token
        assert mx.array_equal(a.keys[..., :64, :], b.keys[..., :64, :]).item()


def test_default_policy_keeps_incompressible_float_kv_raw(tmp_path: Path) -> None:
    path = tmp_path / "x.mlxkv"
    written = write_file_atomically(path, build_header(IDENTITY, list(range(64)), "", None), make_plain_caches(64))
    assert {s.codec for c in written.caches for s in c.slots} == {"raw"}


def test_shuffle_is_chosen_when_it_compresses_best_and_round_trips() -> None:
    import numpy as np

    from mlxkv_ssd_cache import SlotPolicy
    from mlxkv_ssd_cache.slot_codec import choose_codec, decode_slot_into, encode_slot

    # Slowly varying float32: the exponent and high mantissa bytes repeat once grouped.
    data = memoryview(np.linspace(1.0, 1.001, 4096, dtype=np.float32).tobytes())
    assert choose_codec(data, 4, SlotPolicy(level=3)) == "shuffle+zstd"
    stored = encode_slot(data, "shuffle+zstd", 3, 4)
    out = memoryview(bytearray(len(data)))
    decode_slot_into(memoryview(stored), "shuffle+zstd", 4, out)
    assert out.tobytes() == data.tobytes()

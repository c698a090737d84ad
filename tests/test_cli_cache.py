"""`mlxkv cache` subcommands over a real cache directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxkv.cli import build_parser, main
from mlxkv.engine.cache_services import build_tiers
from mlxkv_ssd_cache import KvIdentity, SsdCacheStore
from mlxkv_state.header import GenerationCheckpoint
from tests.factories import make_plain_caches, make_tiny_binding

IDENTITY = KvIdentity("model-a", "tok-a", "fp-a")


def filled(directory: Path) -> list[Path]:
    store = SsdCacheStore(directory, IDENTITY, 1 << 30)
    assert store.store(list(range(30)), make_plain_caches(30))
    assert store.store([7] * 12, make_plain_caches(12), ns="lora-1")
    return sorted(directory.rglob("*.mlxkv"))


def test_ls_lists_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    filled(tmp_path)
    assert main(["cache", "--cache-dir", str(tmp_path), "ls"]) == 0
    out = capsys.readouterr().out
    assert "2 entries" in out and "model-a" in out and "lora-1" in out and "     30 " in out


def test_inspect_prints_the_header(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = filled(tmp_path)[0]
    assert main(["cache", "--cache-dir", str(tmp_path), "inspect", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model_id"] == "model-a" and doc["complete"] is True and doc["format_version"] == 1


def test_verify_reports_a_corrupt_slot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = filled(tmp_path)[0]
    assert main(["cache", "--cache-dir", str(tmp_path), "verify"]) == 0
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 1
    path.write_bytes(bytes(blob))
    assert main(["cache", "--cache-dir", str(tmp_path), "verify"]) == 1
    assert "checksum mismatch" in capsys.readouterr().out


def test_gc_enforces_a_size_cap_and_clear_needs_yes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    filled(tmp_path)
    assert main(["cache", "--cache-dir", str(tmp_path), "gc", "--max-bytes", "1K"]) == 0
    assert "evicted 2 entries" in capsys.readouterr().out
    filled(tmp_path)
    assert main(["cache", "--cache-dir", str(tmp_path), "clear"]) == 1
    assert len(list(tmp_path.rglob("*.mlxkv"))) == 2
    assert main(["cache", "--cache-dir", str(tmp_path), "clear", "--yes"]) == 0
    assert list(tmp_path.rglob("*.mlxkv")) == []


def test_ls_shows_generation_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = SsdCacheStore(tmp_path, IDENTITY, 1 << 30)
    assert store.store(list(range(30)), make_plain_caches(30))
    checkpoint = GenerationCheckpoint(cache_ns="", generated_tokens=(5, 6), key="ab" * 32, original_prompt_tokens=3,
                                      pending_token=7, seed=1, seed_was_explicit=False)
    assert store.save_checkpoint(list(range(12)), make_plain_caches(12), checkpoint)
    assert main(["cache", "--cache-dir", str(tmp_path), "ls"]) == 0
    rows = capsys.readouterr().out.splitlines()
    (row,) = [r for r in rows if "checkpoints/" in r]
    assert row.split()[1:4] == ["-", "checkpoint", "12"] and row.endswith(f"checkpoints/{'ab' * 32}.mlxkv")
    assert rows[-1].startswith("2 entries (1 prompt, 1 checkpoint, 0 object), ")


def test_serve_checkpoint_ttl_option_is_documented_and_validated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as help_exit:
        main(["serve", "--help"])
    assert help_exit.value.code == 0
    assert "--checkpoint-ttl HOURS" in " ".join(capsys.readouterr().out.split())
    assert build_parser().parse_args(["serve", "--checkpoint-ttl", "1.5"]).checkpoint_ttl == 1.5
    assert build_parser().parse_args(["serve"]).checkpoint_ttl == 24.0
    for bad in ("0", "-2", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--checkpoint-ttl", bad])
    assert "hours" in capsys.readouterr().err


def test_checkpoint_ttl_reaches_the_ssd_store(tmp_path: Path) -> None:
    _, cold = build_tiers(make_tiny_binding("llama"), ram_bytes=1 << 20, ssd_dir=tmp_path, ssd_bytes=1 << 30,
                          checkpoint_ttl_s=5400.0)
    assert cold is not None and cold.ssd.checkpoint_ttl_s == 5400.0


def test_ls_shows_an_adapter_stack_namespace_by_its_digests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = SsdCacheStore(tmp_path, IDENTITY, 1 << 30)
    assert store.store([5] * 9, make_plain_caches(9), ns="0123456789abcdef" * 2 + "+" + "fedcba9876543210" * 2)
    assert main(["cache", "--cache-dir", str(tmp_path), "ls"]) == 0
    (line,) = [row for row in capsys.readouterr().out.splitlines() if row.startswith("model-a")]
    assert line.split()[1:4] == ["01234567+fedcba98", "prompt", "9"]

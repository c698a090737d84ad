"""`mlxkv cache` subcommands over a real cache directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxkv.cli import main
from mlxkv_ssd_cache import KvIdentity, SsdCacheStore
from tests.factories import make_plain_caches

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

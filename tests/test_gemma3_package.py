"""The assembled Gemma 3 GGUF is verified by sha256 once, and again only when the file changed."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import pytest

from mlxkv_inference.models.gemma3_270m import GEMMA3_270M_MODULE, gemma3_270m_path



def test_a_verified_file_is_not_hashed_again_until_it_changes(gemma3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package: Any = importlib.import_module(GEMMA3_270M_MODULE)
    calls: list[Path] = []
    assemble = package.assemble

    def counted(target: Path, overwrite: bool = False) -> Any:
        calls.append(Path(target))
        return assemble(target, overwrite=overwrite)

    monkeypatch.setattr(package, "assemble", counted)
    cache_dir = gemma3_path.parent.parent
    assert gemma3_270m_path(cache_dir) == gemma3_path
    assert calls == []  # the fixture's call verified it
    stat = gemma3_path.stat()
    os.utime(gemma3_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gemma3_270m_path(cache_dir) == gemma3_path
    assert calls == [gemma3_path]  # changed: hashed again (and the same sha256 passes)
    assert gemma3_270m_path(cache_dir) == gemma3_path
    assert calls == [gemma3_path]

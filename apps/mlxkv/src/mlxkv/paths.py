"""Default locations and size parsing shared by the subcommands."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
DEFAULT_SSD_BYTES = 20 << 30


def default_cache_dir() -> Path:
    """$MLXKV_CACHE_DIR, else $XDG_CACHE_HOME/mlxkv, else ~/.cache/mlxkv."""
    if env := os.environ.get("MLXKV_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "mlxkv"


def weights_digest_memo() -> Path:
    """Where the weights digests of loaded models are remembered (see `load_binding`)."""
    return default_cache_dir() / "weights-digests.json"


def parse_size(text: str) -> int:
    """'512M', '20G', '1.5G' or a byte count -> bytes, at least one (argparse type)."""
    value = parse_size_or_zero(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least one byte")
    return value


def parse_hours(text: str) -> float:
    """A positive number of hours, e.g. '24' or '0.5' (argparse type)."""
    try:
        hours = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours; use e.g. 24 or 0.5") from None
    if not 0 < hours < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} hours must be a positive number")
    return hours


def parse_size_or_zero(text: str) -> int:
    """Like `parse_size`, but 0 is allowed (it turns the thing off)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 512M, 20G or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def default_ram_cache_bytes() -> int:
    """A quarter of physical memory, at most 8 GiB (2 GiB when it cannot be read)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2 << 30
    return int(min(total // 4, 8 << 30))

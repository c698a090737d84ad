"""How KV is stored: the scheme is part of a model's identity (its config fingerprint)."""

from __future__ import annotations

from dataclasses import dataclass

# mlx-lm's default: short contexts stay in full precision even with --kv-bits.
DEFAULT_QUANTIZED_KV_START = 5000


@dataclass(frozen=True, slots=True)
class KvScheme:
    """How KV is stored: full precision, or affine-quantized from token `quantized_start` on."""

    bits: int | None = None
    group_size: int = 64
    quantized_start: int = DEFAULT_QUANTIZED_KV_START

    def __post_init__(self) -> None:
        if self.bits not in (None, 4, 8):
            raise ValueError(f"kv bits={self.bits!r} is not supported; allowed: 4, 8 or none")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"kv group size={self.group_size!r} is not supported; allowed: 32, 64, 128")
        if self.quantized_start < 0:
            raise ValueError(f"quantized kv start={self.quantized_start!r} must be >= 0")

    def describe(self) -> str:
        if self.bits is None:
            return "full"
        return f"q{self.bits}g{self.group_size}@{self.quantized_start}"

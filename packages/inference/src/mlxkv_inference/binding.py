"""`MlxAutoregressiveBinding`: one loaded model and everything the loop needs from it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv_inference import _mlx_lm
from mlxkv_inference.tokenizer.protocol import Tokenizer

DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True, slots=True)
class KvScheme:
    """How KV is stored: full precision, or affine-quantized from token `quantized_start` on."""

    bits: int | None = None
    group_size: int = 64
    quantized_start: int = 0

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


class MlxAutoregressiveBinding:
    """Owns a model, its tokenizer and identity; runs the prefill and decode phases."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        model_id: str,
        config: dict[str, Any],
        kv_scheme: KvScheme = KvScheme(),
        weights_digest: str = "",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.config = config
        self.kv_scheme = kv_scheme
        self.weight_bytes = _mlx_lm.parameter_bytes(model)
        self.tokenizer_hash = tokenizer.content_hash()
        self.config_fingerprint = config_fingerprint(config, kv_scheme, weights_digest)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_token_ids

    def make_cache(self) -> list[Any]:
        """Fresh per-layer caches for one sequence."""
        return _mlx_lm.make_model_cache(self.model)

    def prefill(self, tokens: Sequence[int], caches: list[Any], chunk_size: int = DEFAULT_PREFILL_CHUNK) -> None:
        """Feed `tokens` into `caches` in chunks, evaluating each chunk (no logits kept)."""
        if chunk_size < 1:
            raise ValueError(f"prefill chunk size={chunk_size} must be >= 1")
        for start in range(0, len(tokens), chunk_size):
            chunk = mx.array(list(tokens[start : start + chunk_size]))[None]
            _mlx_lm.forward(self.model, chunk, caches)
            mx.eval([c.state for c in caches])
            mx.clear_cache()

    def decode(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        """Feed 1-D `tokens` and return the (1, vocab) float32 logits of the last position (lazy)."""
        logits = _mlx_lm.forward(self.model, tokens[None], caches)[:, -1, :]
        return logits if logits.dtype == mx.float32 else logits.astype(mx.float32)


def config_fingerprint(config: dict[str, Any], kv_scheme: KvScheme, weights_digest: str) -> str:
    """Hash of everything that shapes the KV a model computes: graph config, KV scheme, MLX, weights."""
    payload = {
        "config": config,
        "kv_scheme": asdict(kv_scheme),
        "mlx": _mlx_lm.mlx_version(),
        "weights": weights_digest,
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]

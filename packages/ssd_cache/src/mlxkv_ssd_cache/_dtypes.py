"""MLX dtype <-> name and byte views, for tensors stored in slots."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_BY_NAME: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "uint32": mx.uint32,
    "int32": mx.int32,
    "int64": mx.int64,
    "uint8": mx.uint8,
}
_NAMES = {v: k for k, v in _BY_NAME.items()}


def dtype_name(dtype: mx.Dtype) -> str:
    if dtype not in _NAMES:
        raise ValueError(f"dtype {dtype} cannot be stored; supported: {', '.join(_BY_NAME)}")
    return _NAMES[dtype]


def dtype_from_name(name: str) -> mx.Dtype | None:
    return _BY_NAME.get(name)


def tensor_bytes(t: mx.array) -> memoryview:
    """The tensor's bytes in C order (evaluates it; copies only if it is not contiguous)."""
    raw = mx.contiguous(t).reshape(-1).view(mx.uint8)
    mx.eval(raw)
    return np.asarray(raw).data.cast("B")


class SlotBuffer:
    """Fresh MLX memory a slot is read straight into (no intermediate Python bytes)."""

    def __init__(self, nbytes: int) -> None:
        self._raw = mx.zeros((nbytes,), dtype=mx.uint8)
        mx.eval(self._raw)
        self.view = np.asarray(self._raw).data.cast("B")

    def tensor(self, dtype: mx.Dtype, shape: tuple[int, ...]) -> mx.array:
        return self._raw.view(dtype).reshape(shape)

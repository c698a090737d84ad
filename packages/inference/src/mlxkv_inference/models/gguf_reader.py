"""Read a GGUF file: its tensors as MLX arrays (affine triples or float) and its metadata.

MLX's own loader (`mx.load`) is fast but exact only for Q4_0, Q4_1, Q8_0 and F32: it turns Q4_K
and Q6_K silently into float16 (lossy), and refuses Q5_0, Q5_1 and Q5_K. It reads only files of
those four types (as `gguf_file` lists them), and its result is kept only when every tensor came
back as a triple or as float32; any other file's blocks, mapped by `gguf_file`, are converted
here (`gguf_quants`). The `gguf` package's reader (llama.cpp's, the reference `gguf_file` equals)
reads what `gguf_file` leaves to it: big-endian files and other versions.

    name.weight  uint32 packed codes    (quantized tensors, MLX's layout, group size 32)
    name.scales  float32 / float16
    name.biases  float32 / float16
    name.weight  float32 / float16      (float tensors, and Q6_K made float32)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType

from mlxkv_inference import _mlx_lm
from mlxkv_inference.errors import ModelLoadError, UnsupportedModelError
from mlxkv_inference.models.gguf_file import NotReadHere, read_gguf_file
from mlxkv_inference.models.gguf_quants import AFFINE_BITS, DENSE_TYPES, AffineWeight, convert_tensor, supported_type_names

__all__ = ["read_gguf", "scalar"]

_TRIPLE_PARTS = (".scales", ".biases")
_MLX_EXACT = (GGMLQuantizationType.F32, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(tensors, metadata) of the GGUF file at `path`; raises ModelLoadError for a file that
    cannot be read, UnsupportedModelError (naming the tensor, its type and the architecture)
    for a tensor type without a conversion."""
    try:
        file = read_gguf_file(path, strings=False)  # the tensor types decide; MLX reads its own metadata
    except NotReadHere:
        return _read_with_gguf(path)
    if all(t.kind in _MLX_EXACT for t in file.tensors):
        try:
            weights, metadata = _mlx_lm.load_gguf_file(str(path))
        except (RuntimeError, ValueError, OSError):
            pass  # refused by MLX: read it here
        else:
            if all(name.endswith(_TRIPLE_PARTS) or t.dtype in (mx.uint32, mx.float32) for name, t in weights.items()):
                return weights, metadata
    file = file.with_strings()
    return _convert(((t.name, t.kind, t.shape, t.data) for t in file.tensors), file.metadata, path), file.metadata


def scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar; raises ModelLoadError where it is missing and there
    is no default."""
    if key not in metadata:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}")
        return default
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def _read_with_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:  # the reader's faults on a bad file
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    # GGUF lists the innermost axis first
    tensors = ((t.name, t.tensor_type, tuple(int(n) for n in reversed(t.shape)), t.data) for t in reader.tensors)
    return _convert(tensors, metadata, path), metadata


def _convert(tensors: Iterable[tuple[str, GGMLQuantizationType, tuple[int, ...], np.ndarray]],
             metadata: dict[str, Any], path: Path) -> dict[str, mx.array]:
    architecture = metadata.get("general.architecture", "?")
    weights: dict[str, mx.array] = {}
    for name, kind, shape, data in tensors:
        if kind not in AFFINE_BITS and kind not in DENSE_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {name!r} of architecture {architecture!r} has type {kind.name}, "
                f"which mlxkv cannot load; supported: {', '.join(supported_type_names())}"
            )
        try:
            converted = convert_tensor(kind, data, shape)
        except ValueError as e:  # blocks that do not fill the tensor's shape
            raise ModelLoadError(f"GGUF tensor {name!r} in {path} cannot be converted: {e}") from e
        weights.update(_as_mlx(name, converted))
    return weights


def _as_mlx(name: str, converted: AffineWeight | np.ndarray) -> dict[str, mx.array]:
    if isinstance(converted, np.ndarray):
        return {name: mx.array(converted)}
    base = name.removesuffix(".weight")
    return {f"{base}.weight": mx.array(converted.weight), f"{base}.scales": mx.array(converted.scales),
            f"{base}.biases": mx.array(converted.biases)}

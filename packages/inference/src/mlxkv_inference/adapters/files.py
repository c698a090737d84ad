"""Read an mlx-lm adapter directory (LoRA or DoRA, as `mlx_lm.lora` trains them) into an `Adapter`.

    DIR/adapter_config.json    fine_tune_type ("lora" | "dora"), lora_parameters (rank, scale, ...),
                               model (the base it was trained on), num_layers
    DIR/adapters.safetensors   <module path>.lora_a (in, r), .lora_b (r, out), DoRA's .m (out,)

An adapter is identified by a digest of both files' bytes: the same files load to the same
digest, so its KV (cached under that digest, see `AdapterStack.ns`) hits again after a restart.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NewType

import mlx.core as mx
import numpy as np

from mlxkv_inference.errors import AdapterLoadError

AdapterDigest = NewType("AdapterDigest", str)
AdapterKind = Literal["lora", "dora"]
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
_LEAVES = ("lora_a", "lora_b", "m")


@dataclass(frozen=True, slots=True, eq=False)
class LowRank:
    """One adapted linear layer: y + scale * (x @ lora_a) @ lora_b (DoRA: then rescaled by `magnitude`)."""

    lora_a: mx.array  # (in, r)
    lora_b: mx.array  # (r, out)
    magnitude: mx.array | None = None  # DoRA's m: (out,)
    lora_a_t: mx.array | None = None  # lora_a transposed, row-major (r, in): as the native delta reads it


@dataclass(frozen=True, slots=True, eq=False)
class Adapter:
    """A loaded adapter: what it changes (`layers`, by module path in the model) and its identity."""

    digest: AdapterDigest
    path: Path
    kind: AdapterKind
    scale: float
    base_model: str  # adapter_config.json's "model" ("" when it names none)
    layers: Mapping[str, LowRank] = field(repr=False)

    @property
    def rank(self) -> int:
        return max((int(w.lora_a.shape[1]) for w in self.layers.values()), default=0)


@dataclass(frozen=True, slots=True, eq=False)
class AdapterStack:
    """The adapters one request runs under, applied in order (empty: the base model)."""

    adapters: tuple[Adapter, ...] = ()

    def __post_init__(self) -> None:
        if len(self.adapters) > 1 and any(a.kind == "dora" for a in self.adapters):
            raise ValueError(f"a DoRA adapter cannot be stacked ({'+'.join(str(a.path) for a in self.adapters)}): "
                             "its magnitude rescales the whole adapted weight")
        if len({a.digest for a in self.adapters}) < len(self.adapters):
            raise ValueError(f"an adapter is stacked twice: {self.ns}")

    @property
    def ns(self) -> str:
        """The cache namespace: the digests joined with "+" ("" for the base model)."""
        return "+".join(a.digest for a in self.adapters)


def load_adapter(path: str | Path) -> Adapter:
    """Read the mlx-lm adapter directory `path`.

    Raises:
        AdapterLoadError: a missing, unreadable or corrupt file, or a fine-tune type that is not
            LoRA or DoRA ("full" fine-tunes are models: serve them with --model).
    """
    directory = Path(path).expanduser()
    config_bytes = _read(directory / CONFIG_FILE)
    weights_bytes = _read(directory / WEIGHTS_FILE)
    config = _config(directory, config_bytes)
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterLoadError(f"adapter {directory}: fine_tune_type {kind!r} is not 'lora' or 'dora'")
    parameters = config.get("lora_parameters")
    scale = parameters.get("scale") if isinstance(parameters, dict) else None
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise AdapterLoadError(f"adapter {directory}: lora_parameters.scale is {scale!r}, not a number")
    digest = hashlib.sha256(config_bytes)
    digest.update(weights_bytes)
    base = config.get("model")
    return Adapter(AdapterDigest(digest.hexdigest()[:32]), directory.resolve(), kind, float(scale),
                   base if isinstance(base, str) else "", _layers(directory, kind, weights_bytes))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise AdapterLoadError(f"cannot read adapter file {path}: {e.strerror or e}") from e


def _config(directory: Path, data: bytes) -> dict[str, object]:
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterLoadError(f"adapter {directory}: {CONFIG_FILE} is not JSON ({e})") from e
    if not isinstance(config, dict):
        raise AdapterLoadError(f"adapter {directory}: {CONFIG_FILE} holds {type(config).__name__}, not an object")
    return config


def _layers(directory: Path, kind: AdapterKind, data: bytes) -> dict[str, LowRank]:
    try:
        tensors = read_safetensors(data)
    except ValueError as e:
        raise AdapterLoadError(f"adapter {directory}: {WEIGHTS_FILE} is not a readable safetensors file ({e})") from e
    if not tensors:
        raise AdapterLoadError(f"adapter {directory}: {WEIGHTS_FILE} holds no tensors")
    grouped: dict[str, dict[str, mx.array]] = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in _LEAVES or not module:
            raise AdapterLoadError(f"adapter {directory}: {name!r} is not a LoRA/DoRA parameter (lora_a, lora_b, m)")
        grouped.setdefault(module, {})[leaf] = tensor
    layers = {}
    for module, leaves in grouped.items():
        wanted = {"lora_a", "lora_b"} | ({"m"} if kind == "dora" else set())
        if set(leaves) != wanted:
            raise AdapterLoadError(f"adapter {directory}: {module} has {sorted(leaves)}, a {kind} layer needs {sorted(wanted)}")
        a, b = leaves["lora_a"], leaves["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise AdapterLoadError(f"adapter {directory}: {module} lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} "
                                   "are not a low-rank pair")
        layers[module] = LowRank(a, b, leaves.get("m"), _transposed(a))
    return layers


def _transposed(a: mx.array) -> mx.array:
    """a^T as its own row-major array, copied now (nothing left to evaluate; see read_safetensors)."""
    return mx.array(np.ascontiguousarray(np.asarray(a).T))


def read_safetensors(data: bytes) -> dict[str, mx.array]:
    """The tensors of a safetensors file's bytes, copied into MLX arrays (nothing left to
    evaluate: a server loads adapters off the thread that runs MLX's graphs).

    Raises ValueError for anything malformed (short, bad header, offsets out of range, a dtype
    other than F32, F16 or BF16)."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, shorter than the 8-byte header length")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError(f"the header claims {size} bytes, the file has {len(data) - 8} after the length")
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    body = memoryview(data)[8 + size :]
    return {name: _tensor(name, entry, body) for name, entry in header.items() if name != "__metadata__"}


_DTYPES = {"F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.uint16, mx.bfloat16)}


def _tensor(name: str, entry: object, body: memoryview) -> mx.array:
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        raise ValueError(f"{name}: dtype {entry.get('dtype') if isinstance(entry, dict) else entry!r} is not F32, F16 or BF16")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise ValueError(f"{name}: bad shape {shape!r} or data_offsets {offsets!r}")
    numpy_type, view = _DTYPES[entry["dtype"]]
    start, end = offsets
    if not 0 <= start <= end <= len(body) or end - start != int(np.prod(shape)) * np.dtype(numpy_type).itemsize:
        raise ValueError(f"{name}: data_offsets {offsets} do not hold shape {shape} in a {len(body)}-byte body")
    array = mx.array(np.frombuffer(body[start:end], dtype=numpy_type).reshape(shape))
    return array.view(view) if view is not None else array

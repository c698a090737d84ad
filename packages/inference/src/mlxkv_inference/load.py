"""Load a model by path into the binding that runs it: the embedded GGUF, a llama or gemma3 GGUF
file, or a local mlx-lm directory. It sits above `binding.py` (the binding never imports it).

Nothing is downloaded: a path that does not exist is an error, never a hub lookup.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlxkv_inference import _mlx_lm
from mlxkv_inference.binding import MlxAutoregressiveBinding
from mlxkv_inference.kv_scheme import KvScheme
from mlxkv_inference.errors import ModelLoadError
from mlxkv_inference.native.kernels import CpuKernels
from mlxkv_inference.models.embedded import EMBEDDED_MODEL_ID, embedded_model_path
from mlxkv_inference.models.gguf import load_gguf
from mlxkv_inference.models.weights_digest import weights_digest
from mlxkv_inference.tokenizer.gguf_tokenizer import GgufTokenizer
from mlxkv_inference.tokenizer.hf_tokenizer import HfTokenizer


def load_binding(
    model: str | Path | None = None, kv_scheme: KvScheme = KvScheme(), cpu_kernels: CpuKernels = "mlx", *,
    digest_memo: Path | None = None, model_id: str | None = None,
) -> MlxAutoregressiveBinding:
    """Load `model` (None: the embedded SmolLM2) and bind it with `kv_scheme` and `cpu_kernels`;
    `model_id` names it (default: the file's stem or the directory's name).

    `digest_memo`: a JSON file remembering the weights digest, so a restart does not re-read
    the weights to fingerprint them (None: digest them every time).
    """
    if model is None:
        return load_gguf_binding(embedded_model_path(), kv_scheme, model_id=EMBEDDED_MODEL_ID, cpu_kernels=cpu_kernels,
                                 digest_memo=digest_memo)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_binding(path, kv_scheme, model_id, cpu_kernels=cpu_kernels, digest_memo=digest_memo)
    if path.is_dir() and (path / "config.json").is_file():
        return load_directory_binding(path, kv_scheme, cpu_kernels, digest_memo=digest_memo, model_id=model_id)
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist; --model takes a local mlx-lm directory or a .gguf file "
            "(nothing is downloaded)"
        )
    raise ModelLoadError(f"{str(path)!r} is neither a .gguf file nor a directory with config.json")


def load_gguf_binding(
    path: Path, kv_scheme: KvScheme, model_id: str | None = None, cpu_kernels: CpuKernels = "mlx",
    digest_memo: Path | None = None,
) -> MlxAutoregressiveBinding:
    loaded = load_gguf(path)
    return MlxAutoregressiveBinding(
        loaded.model,
        GgufTokenizer(loaded.metadata),
        model_id=model_id or path.stem,
        config=loaded.config,
        kv_scheme=kv_scheme,
        weights_digest=weights_digest([path], digest_memo),
        cpu_kernels=cpu_kernels,
    )


def load_directory_binding(
    path: Path, kv_scheme: KvScheme, cpu_kernels: CpuKernels = "mlx", digest_memo: Path | None = None,
    model_id: str | None = None,
) -> MlxAutoregressiveBinding:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        model, wrapper, config = _mlx_lm.load_directory(path)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load mlx-lm model directory {path}: {e}") from e
    return MlxAutoregressiveBinding(
        model,
        HfTokenizer(wrapper, path),
        model_id=model_id or path.resolve().name,
        config=config,
        kv_scheme=kv_scheme,
        weights_digest=weights_digest(sorted(path.glob("*.safetensors")), digest_memo),
        cpu_kernels=cpu_kernels,
    )

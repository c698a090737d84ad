"""Where a model comes from: `--model` values (`NAME=SOURCE` or `SOURCE`), `--models-dir`, and
Hugging Face repo ids resolved through the local hub cache (downloaded when online, as mlx_lm
does).

    SOURCE     a .gguf file, an mlx-lm directory, `org/name` (a Hugging Face id), or `embedded`
    hub cache  $HF_HUB_CACHE (default $HF_HOME/hub): models--org--name/snapshots/<commit>/...
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mlxkv_inference.errors import ModelLoadError
from mlxkv_inference.models.embedded import EMBEDDED_MODEL_ID

from mlxkv.engine.models import ModelSpec

EMBEDDED = "embedded"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What mlx_lm downloads of a repo (its `_download`): configs, weights, tokenizer files, templates.
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
                  "*.jsonl", "*.jinja"]


def parse_model_specs(values: list[str], models_dir: Path | None) -> list[ModelSpec]:
    """The registered models, in order; raises ValueError for a duplicate name or a bad value."""
    specs = [parse_model_spec(v) for v in values]
    if models_dir is not None:
        specs += scan_models_dir(models_dir)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"two models are named {spec.name!r}; name them apart with --model NAME=PATH")
        seen.add(spec.name)
    return specs


def parse_model_spec(value: str) -> ModelSpec:
    """`NAME=SOURCE`, or `SOURCE` named after itself (a file's stem, a directory's name, the id)."""
    name, sep, source = value.partition("=")
    if not sep or not name or Path(value).expanduser().exists():
        name, source = default_name(value), value
    if not source:
        raise ValueError(f"--model {value!r} names no model; give NAME=PATH, a path or a Hugging Face id")
    return ModelSpec(name, None if source == EMBEDDED else source)


def default_name(source: str) -> str:
    if source == EMBEDDED:
        return EMBEDDED_MODEL_ID
    path = Path(source).expanduser()
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return source  # a Hugging Face id is its own name, as clients of mlx_lm.server send it


def scan_models_dir(directory: Path) -> list[ModelSpec]:
    """Each mlx-lm directory (with config.json) and .gguf file in `directory`, by name."""
    if not directory.is_dir():
        raise ValueError(f"--models-dir {str(directory)!r} is not a directory")
    found = [ModelSpec(p.name, str(p)) for p in sorted(directory.iterdir()) if p.is_dir() and (p / "config.json").is_file()]
    found += [ModelSpec(p.stem, str(p)) for p in sorted(directory.glob("*.gguf")) if p.is_file()]
    if not found:
        raise ValueError(f"--models-dir {str(directory)!r} holds no model (an mlx-lm directory or a .gguf file)")
    return found


def is_hub_id(source: str) -> bool:
    return not Path(source).expanduser().exists() and _HUB_ID.fullmatch(source) is not None


def resolve_source(source: str | None, *, offline: bool | None = None, cache_dir: Path | None = None) -> Path | None:
    """The local path of `source` (None: the embedded model); a Hugging Face id resolves to its
    snapshot in the hub cache, downloaded first unless `offline` (default: `HF_HUB_OFFLINE`)."""
    if source is None or source == EMBEDDED:
        return None
    if not is_hub_id(source):
        return Path(source).expanduser()
    return hub_snapshot(source, offline=hub_offline() if offline is None else offline, cache_dir=cache_dir)


def hub_snapshot(repo_id: str, *, offline: bool, cache_dir: Path | None = None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    where = cache_dir or hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, local_files_only=offline, cache_dir=str(where)))
    except LocalEntryNotFoundError:
        raise ModelLoadError(f"{repo_id!r} is not in the Hugging Face cache ({where})"
                             + (" and HF_HUB_OFFLINE is set: download it first (or unset HF_HUB_OFFLINE)" if offline
                                else " and could not be downloaded")) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelLoadError(f"cannot get {repo_id!r} from the Hugging Face hub: {e}") from None


def hub_cached(repo_id: str, cache_dir: Path | None = None) -> bool:
    """Whether `repo_id` has a snapshot in the local hub cache (never touches the network)."""
    try:
        hub_snapshot(repo_id, offline=True, cache_dir=cache_dir)
    except ModelLoadError:
        return False
    return True


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> Path:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else the hub's default, read now (not when
    huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def discover_cached(name: str) -> ModelSpec | None:
    """A request's `model` that is a Hugging Face id with a snapshot in the local hub cache, as a
    model to serve (never downloads: a client must not make the server fetch gigabytes)."""
    return ModelSpec(name, name) if is_hub_id(name) and hub_cached(name) else None

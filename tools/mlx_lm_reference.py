"""mlx-lm's own server as a reference: write a llama or gemma3 GGUF (default: the embedded SmolLM2) out as an
mlx-lm model directory with the very same quantized weights, and run `mlx_lm.server` on it.

    DIR/config.json             mlx-lm llama config, with each quantized layer's bits and group size
    DIR/model.safetensors       the weights as mlxkv loads them (Q/K rows un-permuted, float32 scales)
    DIR/tokenizer.json          the byte-level BPE mlxkv rebuilds from the GGUF metadata
    DIR/tokenizer_config.json   BOS/EOS tokens and the chat template

Run: `uv run python -m tools.mlx_lm_reference DIR [--gguf FILE]` (writes the directory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from mlxkv_inference.models.embedded import embedded_model_path  # first: the BLAS shim precedes mlx
from mlxkv_inference.models.gguf import load_gguf
from mlxkv_inference.tokenizer.gguf_tokenizer import GgufTokenizer

import mlx.core as mx  # noqa: E402, I001
import mlx.nn as nn
from mlx.utils import tree_flatten
from tests.server_process import wait_until_healthy
from tests.serving import free_port


def write_mlx_lm_directory(directory: Path, gguf: Path | None = None) -> Path:
    """Write `gguf` (None: the embedded model) into the new directory `directory`; returns it."""
    loaded = load_gguf(gguf or embedded_model_path())
    tokenizer = GgufTokenizer(loaded.metadata)
    directory.mkdir(parents=True)
    config = {**loaded.config, "quantization": quantization_layouts(loaded.model),
              "eos_token_id": sorted(tokenizer.eos_token_ids)}
    if tokenizer.bos_token_id is not None:
        config["bos_token_id"] = tokenizer.bos_token_id
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    weights: dict[str, mx.array] = dict(tree_flatten(loaded.model.parameters()))  # type: ignore[no-untyped-call]
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_settings(tokenizer, loaded.metadata), indent=2))
    return directory


def quantization_layouts(model: nn.Module) -> dict[str, Any]:
    """mlx-lm's `quantization` entry: the most common bits and group size, and the modules that
    differ from it by path (a GGUF may mix Q4 and Q8 tensors; mlx-lm reads per-path entries first)."""
    layouts = {path: (module.group_size, module.bits) for path, module in model.named_modules()  # type: ignore[no-untyped-call]
               if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    if not layouts:
        raise ValueError("the model has no quantized layers; nothing to describe")
    common = Counter(layouts.values()).most_common(1)[0][0]
    entry: dict[str, Any] = {"group_size": common[0], "bits": common[1]}
    for path, (group_size, bits) in layouts.items():
        if (group_size, bits) != common:
            entry[path] = {"group_size": group_size, "bits": bits}
    return entry


def tokenizer_settings(tokenizer: GgufTokenizer, metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json for `transformers`' fast tokenizer over our tokenizer.json."""
    backend = tokenizer.backend
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    eos = min(tokenizer.eos_token_ids, default=None)
    if eos is not None:
        settings["eos_token"] = backend.id_to_token(eos)
    if tokenizer.bos_token_id is not None:
        settings["bos_token"] = backend.id_to_token(tokenizer.bos_token_id)
    template = metadata.get("tokenizer.chat_template")
    if template:
        settings["chat_template"] = str(template)
    return settings


class MlxLmServer:
    """`python -m mlx_lm.server` on a model directory, with its own batching (default
    `--decode-concurrency 32`, `--prompt-concurrency 8`); its prompt cache is off (`--prompt-cache-size 0`)
    so that, like the mlxkv servers it is compared with, every request prefills its whole prompt."""

    def __init__(self, model: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = model.parent / f"mlx-lm-server-{self.port}.log"
        self._log_file = self.log.open("w")
        command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                   "--prompt-cache-size", "0", "--log-level", "WARNING", *extra]
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT, env=environment)
        wait_until_healthy("mlx_lm.server", self.process, self.url, self.log, 300)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        self._log_file.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="the directory to create")
    parser.add_argument("--gguf", type=Path, default=None, help="a llama or gemma3 .gguf file (default: the embedded model)")
    args = parser.parse_args()
    print(write_mlx_lm_directory(args.directory, args.gguf))


if __name__ == "__main__":
    main()

"""Factories for adapter tests: mlx-lm model directories of the tiny models, adapters trained on
them with mlx-lm's LoRA trainer, and random adapters where training adds nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference._mlx_lm import build_model, train_adapter
from mlxkv_inference.adapters import AdapterStack, load_adapter
from mlxkv_inference.cache.factory import LayerCache
from tests.factories import make_prompt

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def write_trained_adapter(binding: MlxAutoregressiveBinding, directory: Path, *, kind: str = "lora", seed: int = 0,
                          iters: int = 4) -> Path:
    """An adapter trained for `iters` steps with mlx-lm's trainer on a fresh copy of `binding`'s model
    (a few random sequences of byte ids, different per `seed`); returns its directory."""
    model = build_model(binding.config)
    model.update(binding.model.parameters())  # type: ignore[no-untyped-call]
    mx.random.seed(seed)
    sequences = [make_prompt(24, seed=100 + seed * 10 + i) for i in range(4)]
    train_adapter(model, sequences, directory, fine_tune_type=kind, num_layers=len(binding.model.layers),
                  iters=iters, base_model=binding.model_id)
    return directory


def write_random_adapter(binding: MlxAutoregressiveBinding, directory: Path, *, seed: int = 0, rank: int = 4,
                         scale: float = 4.0, kind: str = "lora", layers: list[int] | None = None,
                         linears: tuple[str, ...] = LINEARS, base_model: str = "") -> Path:
    """An mlx-lm adapter directory with random low-rank weights (lora_b nonzero, unlike a fresh
    adapter's) for `linears` of `layers` (default all); returns it."""
    model: Any = binding.model
    keys = iter(mx.random.split(mx.random.key(seed), 64 * len(model.layers)))
    tensors: dict[str, mx.array] = {}
    for index in layers if layers is not None else range(len(model.layers)):
        for name in linears:
            path = f"model.layers.{index}.{name}"
            inputs, outputs = _dims(model, path)
            tensors[f"{path}.lora_a"] = mx.random.normal((inputs, rank), key=next(keys)) * inputs ** -0.5
            tensors[f"{path}.lora_b"] = mx.random.normal((rank, outputs), key=next(keys)) * 0.05
            if kind == "dora":
                tensors[f"{path}.m"] = 1.0 + 0.1 * mx.random.normal((outputs,), key=next(keys))
    directory.mkdir(parents=True)
    config = {"fine_tune_type": kind, "num_layers": len(model.layers), "model": base_model,
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0}}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "adapters.safetensors"), tensors)
    return directory


def adapted_caches(binding: MlxAutoregressiveBinding, *directories: Path) -> list[LayerCache]:
    """Fresh caches of `binding` tagged with the adapters of `directories` (none: the base)."""
    return binding.adapters.tag(binding.make_cache(), AdapterStack(tuple(load_adapter(d) for d in directories)))


def _dims(model: Any, path: str) -> tuple[int, int]:
    module: Any = model
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    weight = module.weight
    bits = getattr(module, "bits", 32)
    return int(weight.shape[1] * 32 // bits), int(weight.shape[0])

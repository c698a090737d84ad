"""adapters: mlx-lm LoRA/DoRA adapter directories, checked against a model and applied per row."""

from mlxkv_inference.adapters.bank import AdaptedCaches, AdapterBank
from mlxkv_inference.adapters.files import Adapter, AdapterDigest, AdapterStack, LowRank, load_adapter

__all__ = ["AdaptedCaches", "Adapter", "AdapterBank", "AdapterDigest", "AdapterStack", "LowRank", "load_adapter"]

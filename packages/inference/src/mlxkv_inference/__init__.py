"""mlxkv inference: model binding, caches, the autoregressive loop and the sampler."""

# NOTE: first, before anything imports mlx: the BLAS shim only wins if loaded ahead of libmlx.
from mlxkv_inference._blas import load_native_blas

load_native_blas()

from mlxkv_inference.binding import DEFAULT_PREFILL_CHUNK, MlxAutoregressiveBinding
from mlxkv_inference.kv_scheme import DEFAULT_QUANTIZED_KV_START, KvScheme
from mlxkv_inference.generation.constraint import Grammar, GrammarConstraint, compile_grammar
from mlxkv_inference.generation.detokenizer import IncrementalDetokenizer
from mlxkv_inference.generation.generate import Generation
from mlxkv_inference.generation.results import GenerationParams, GenerationResult, TextDelta
from mlxkv_inference.generation.loop import SequenceRun, TokenStep
from mlxkv_inference.generation.sampling import SamplingParams, make_sampler, step_key
from mlxkv_inference.errors import ModelLoadError, UnsupportedModelError
from mlxkv_inference.models.embedded import EMBEDDED_MODEL_ID, embedded_model_path
from mlxkv_inference.load import load_binding
from mlxkv_inference.tokenizer.protocol import Message, Tokenizer

__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "DEFAULT_QUANTIZED_KV_START",
    "EMBEDDED_MODEL_ID",
    "Generation",
    "Grammar",
    "GrammarConstraint",
    "GenerationParams",
    "GenerationResult",
    "IncrementalDetokenizer",
    "KvScheme",
    "Message",
    "MlxAutoregressiveBinding",
    "ModelLoadError",
    "SamplingParams",
    "TextDelta",
    "TokenStep",
    "Tokenizer",
    "UnsupportedModelError",
    "compile_grammar",
    "embedded_model_path",
    "SequenceRun",
    "load_binding",
    "make_sampler",
    "step_key",
]

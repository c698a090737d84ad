"""The one place where this package makes untyped calls (mlx-lm, and a few MLX functions).

Every function here has a typed signature so the rest of the package stays under
`mypy --strict`; the module itself is the only one with `disallow_untyped_calls` relaxed.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
import mlx.core as mx
import mlx.nn as nn


def forward(model: nn.Module, tokens: mx.array, cache: list[Any] | None) -> mx.array:
    """Run the model on a (1, L) token batch and return (1, L, vocab) logits."""
    out: mx.array = model(tokens, cache=cache)
    return out


def model_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.layers)


def make_model_cache(model: nn.Module) -> list[Any]:
    """mlx-lm's own per-layer caches for `model` (its `make_cache` or plain KV caches)."""
    from mlx_lm.models.cache import make_prompt_cache

    caches: list[Any] = make_prompt_cache(model)
    return caches


def model_classes(config: dict[str, Any]) -> tuple[type[nn.Module], type[Any]]:
    """Model and args classes mlx-lm uses for `config["model_type"]`."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    return model_cls, args_cls


def build_model(config: dict[str, Any]) -> nn.Module:
    """Instantiate an mlx-lm model (random weights) from a config dict."""
    model_cls, args_cls = model_classes(config)
    args = args_cls.from_dict(config)
    factory: Any = model_cls
    model: nn.Module = factory(args)
    return model


def sanitize(model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    if hasattr(model, "sanitize"):
        out: dict[str, mx.array] = model.sanitize(weights)
        return out
    return weights


def load_directory(path: Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Load a local mlx-lm model directory: (model, TokenizerWrapper, config)."""
    from mlx_lm.utils import load

    loaded: Any = load(str(path), return_config=True)
    return loaded[0], loaded[1], loaded[2]


def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    from mlx_lm.sample_utils import apply_top_k as _top_k

    out: mx.array = _top_k(logprobs, top_k)
    return out


def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    from mlx_lm.sample_utils import apply_top_p as _top_p

    out: mx.array = _top_p(logprobs, top_p)
    return out


def apply_min_p(logprobs: mx.array, min_p: float) -> mx.array:
    from mlx_lm.sample_utils import apply_min_p as _min_p

    out: mx.array = _min_p(logprobs, min_p)
    return out


def create_attention_mask(h: mx.array, cache: Any, window_size: int | None = None) -> Any:
    from mlx_lm.models.base import create_attention_mask as _mask

    return _mask(h, cache, window_size=window_size)


def eos_token_ids(wrapper: Any) -> list[int]:
    return list(wrapper.eos_token_ids)


def tokenizer_vocab_size(wrapper: Any) -> int:
    return int(len(wrapper._tokenizer))


def tokenizer_encode(wrapper: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(wrapper.encode(text, add_special_tokens=add_special_tokens))


def tokenizer_decode(wrapper: Any, ids: list[int]) -> str:
    return str(wrapper.decode(ids))


def tokenizer_chat_template(
    wrapper: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    if getattr(wrapper, "chat_template", None) is None:
        raise ValueError("this model has no chat template; use raw prompts")
    try:
        return str(wrapper.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools,
                                               **template_kwargs))
    except jinja2.TemplateError as e:  # the template failed on these messages or tools: the caller's 400
        raise ValueError(f"chat template error: {e}") from e


def async_eval(*arrays: mx.array) -> None:
    """`mx.async_eval` (untyped in MLX's stubs)."""
    mx.async_eval(*arrays)


def load_gguf_file(path: str) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """`mx.load` of a GGUF file: (tensors, metadata)."""
    loaded: Any = mx.load(path, return_metadata=True)
    return loaded[0], loaded[1]


def mlx_version() -> str:
    return str(getattr(mx, "__version__", "unknown"))


def parameter_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters."""
    from mlx.utils import tree_flatten

    leaves: Any = tree_flatten(model.parameters())
    return sum(int(v.nbytes) for _, v in leaves)


def eval_parameters(model: nn.Module) -> None:
    mx.eval(model.parameters())


def wrap_tokenizer(backend: Any, eos_token_ids: list[int]) -> Any:
    """mlx-lm's `TokenizerWrapper` over a `tokenizers.Tokenizer`, so mlx-lm's own generation can
    run with our GGUF tokenizer (used as the reference in parity tests and benchmarks)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    return TokenizerWrapper(hf, eos_token_ids=eos_token_ids)


def mlx_lm_stream_responses(model: nn.Module, wrapper: Any, prompt: list[int], max_tokens: int, **kwargs: Any) -> Iterator[Any]:
    """mlx-lm's `stream_generate` responses (one per token; the last carries finish_reason)."""
    from mlx_lm.generate import stream_generate

    yield from stream_generate(model, wrapper, prompt, max_tokens=max_tokens, **kwargs)


def mlx_lm_stream_tokens(model: nn.Module, wrapper: Any, prompt: list[int], max_tokens: int, **kwargs: Any) -> list[int]:
    """Token ids mlx-lm's `stream_generate` produces (the EOS that ends it is dropped)."""
    tokens: list[int] = []
    for response in mlx_lm_stream_responses(model, wrapper, prompt, max_tokens, **kwargs):
        if response.finish_reason == "stop":
            break
        tokens.append(int(response.token))
    return tokens


def mlx_lm_step_tokens(model: nn.Module, prompt: list[int], max_tokens: int, **kwargs: Any) -> list[int]:
    """Token ids of mlx-lm's `generate_step` (no tokenizer, no EOS handling)."""
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, **kwargs)]


def describe_model_caches(model: nn.Module) -> list[tuple[str, dict[str, int]]]:
    """The kind and parameters of each cache mlx-lm would build for `model`, layer by layer."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    out: list[tuple[str, dict[str, int]]] = []
    for cache in make_model_cache(model):
        if isinstance(cache, RotatingKVCache):
            out.append(("rotating", {"max_size": int(cache.max_size), "keep": int(cache.keep)}))
        elif type(cache) is KVCache:
            out.append(("plain", {}))
        elif type(cache) is ArraysCache:
            out.append(("recurrent", {"size": len(cache.cache)}))
        else:
            out.append((type(cache).__name__, {}))
    return out


def mlx_lm_prompt_cache_turn(
    model: nn.Module, backend: Any, state: dict[str, Any], prompt: list[int], max_tokens: int,
    first_token: Callable[[Iterator[Any]], float],
) -> float:
    """One chat turn the way mlx-lm's server serves it: `LRUPromptCache.fetch_nearest_cache`,
    `stream_generate` on the rest, then `insert_cache` of what the cache holds. Returns
    `first_token(stream)` (the caller times the stream); `state` keeps the LRU between turns."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    lru = state.setdefault("lru", LRUPromptCache(max_size=10))
    wrapper = state.setdefault("wrapper", wrap_tokenizer(backend, eos_token_ids=[]))
    cache, rest = lru.fetch_nearest_cache("model", prompt)
    if cache is None:
        cache, rest = make_prompt_cache(model), prompt
    generated: list[int] = []

    def tokens() -> Iterator[Any]:
        for response in stream_generate(model, wrapper, rest, max_tokens=max_tokens, prompt_cache=cache):
            generated.append(int(response.token))
            yield response

    stream = tokens()
    elapsed = first_token(stream)
    for _ in stream:
        pass
    lru.insert_cache("model", (prompt + generated)[: cache[0].offset], cache)
    return elapsed


def attention(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` (quantized caches included)."""
    from mlx_lm.models.base import scaled_dot_product_attention

    out: mx.array = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask)
    return out


def load_with_adapter(path: Path, adapter_path: Path) -> nn.Module:
    """mlx-lm's own `load(path, adapter_path=...)`: the model with the adapter's LoRA/DoRA layers
    (the oracle adapted generations are checked against)."""
    from mlx_lm.utils import load

    loaded: Any = load(str(path), adapter_path=str(adapter_path))
    model: nn.Module = loaded[0]
    return model


def train_adapter(model: nn.Module, sequences: list[list[int]], adapter_path: Path, *, fine_tune_type: str = "lora",
                  num_layers: int = 2, rank: int = 4, scale: float = 10.0, iters: int = 4,
                  learning_rate: float = 1e-2, base_model: str = "") -> None:
    """Train an adapter with mlx-lm's LoRA trainer (`mlx_lm.lora`'s machinery, in process) on
    `sequences` of token ids, writing `adapter_path` as `mlx_lm.lora` does (config + weights).
    `model` is changed (its linears become LoRA layers): pass a fresh copy."""
    import mlx.optimizers as optim
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import save_config

    parameters = {"rank": rank, "scale": scale, "dropout": 0.0}
    model.freeze()
    linear_to_lora_layers(model, num_layers, parameters, use_dora=fine_tune_type == "dora")
    adapter_path.mkdir(parents=True, exist_ok=True)
    save_config({"fine_tune_type": fine_tune_type, "num_layers": num_layers, "lora_parameters": parameters,
                 "model": base_model, "iters": iters, "learning_rate": learning_rate},
                adapter_path / "adapter_config.json")
    args = TrainingArgs(batch_size=1, iters=iters, val_batches=0, steps_per_report=iters, steps_per_eval=iters + 1,
                        steps_per_save=iters + 1, max_seq_length=512,
                        adapter_file=str(adapter_path / "adapters.safetensors"))
    dataset = [(list(tokens), 0) for tokens in sequences]
    train(model, optim.Adam(learning_rate=learning_rate), dataset, None, args=args)


def apply_adapter(model: nn.Module, adapter_path: Path) -> nn.Module:
    """mlx-lm's `load_adapters` (what `load(..., adapter_path=...)` runs on the model it loaded)."""
    from mlx_lm.tuner.utils import load_adapters

    adapted: nn.Module = load_adapters(model, str(adapter_path))
    return adapted


def gemma_residual(layer: nn.Module) -> Callable[[mx.array, mx.array], mx.array]:
    """The residual add of a Gemma 3 block (`clip_residual` in its mlx-lm module)."""
    import sys

    add: Callable[[mx.array, mx.array], mx.array] = getattr(sys.modules[type(layer).__module__], "clip_residual")
    return add

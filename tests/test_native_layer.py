"""A decoder layer as one native node gives the bits of its separate nodes (llama and Qwen3 blocks).

The oracle is the same binding with the fused node turned off (`_fused_parts` answering None):
norms, products, attention, SwiGLU and the residual adds as separate MLX nodes. Logits and the
keys and values written must agree bit for bit in every forward the engine runs: chunked prefill,
a decode step, a speculative round's rows, the compiled step and the batched step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference._mlx_lm import build_model, eval_parameters
from mlxkv_inference.cache.kv import PlainKVCache
from mlxkv_inference.native import layer as native_layer
from mlxkv_inference.native.batched import decode_batch
from tests.factories import ByteTokenizer, _randomize, make_prompt, make_tiny_binding, make_tiny_config

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the native CPU kernels are Linux-only")


def forwards(binding: MlxAutoregressiveBinding, prompt: list[int]) -> list[np.ndarray]:
    """Logits of a prefill in chunks of 5 then one decode step and a 3-row round, then each of
    two sequences' logits in a batched step (1 row and 3 rows), and every cache's keys and values."""
    caches = binding.make_cache()
    binding.prefill(prompt, caches, chunk_size=5)
    out = [np.array(binding.decode(mx.array([7]), caches)), np.array(binding.decode(mx.array([3, 1, 4]), caches))]
    other = binding.make_cache()
    binding.prefill(prompt[:9], other)
    out.append(np.array(decode_batch(binding.model, mx.array([9, 2, 6, 5]), [caches, other], lengths=[1, 3])))
    for sequence in (caches, other):
        for cache in sequence:
            assert isinstance(cache, PlainKVCache) and cache.keys is not None and cache.values is not None
            out += [np.array(cache.keys[..., : cache.offset, :]), np.array(cache.values[..., : cache.offset, :])]
    return out


def unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_layer, "_fused_parts", lambda layer: None)


def assert_fused(binding: MlxAutoregressiveBinding) -> None:
    layers: Any = getattr(binding.model, "model").layers
    assert all(isinstance(layer, native_layer.NativeLayerMixin) for layer in layers)
    assert all(native_layer._fused_parts(layer) is not None for layer in layers)


def test_the_embedded_model_s_layers_in_one_node_give_the_bits_of_separate_nodes(
    embedded_native: MlxAutoregressiveBinding, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert_fused(embedded_native)
    prompt = embedded_native.tokenizer.encode("Name three rivers and the seas they flow into.")
    caches = embedded_native.make_cache()
    embedded_native.prefill(prompt, caches)
    mx.export_to_dot(str(tmp_path / "step.dot"), embedded_native.decode(mx.array([7]), caches))
    assert (tmp_path / "step.dot").read_text().count('label ="MlxkvNativeDecoderLayer') == 30
    for cache in caches:
        cache.trim(1)  # the step above was graphed, not run: its position is fed again, compiled
    compiled = embedded_native.decode_compiled(mx.array([7]), caches)
    assert compiled is not None
    fused = forwards(embedded_native, prompt) + [np.array(compiled)]
    unfused(monkeypatch)
    caches = embedded_native.make_cache()
    embedded_native.prefill(prompt, caches)
    plain = forwards(embedded_native, prompt) + [np.array(embedded_native.decode(mx.array([7]), caches))]
    assert len(fused) == len(plain)
    for got, want in zip(fused, plain, strict=True):
        assert np.array_equal(got, want)


def tiny_llama(bits: dict[str, tuple[int, int]]) -> MlxAutoregressiveBinding:
    """A random-weight llama whose products are quantized per `bits` (name suffix: (bits, group
    size); the rest 4 bits in groups of 32), bound on the native path."""
    from tests.factories import ByteTokenizer

    config = make_tiny_config("llama", num_attention_heads=8, num_key_value_heads=2, hidden_size=128)
    model = build_model(config)
    _randomize(model, 3)

    def quantize(path: str, module: nn.Module) -> bool | dict[str, int]:
        if not isinstance(module, nn.Linear | nn.Embedding):
            return False
        for suffix, (b, group) in bits.items():
            if path.endswith(suffix):
                return {"bits": b, "group_size": group}
        return True

    nn.quantize(model, group_size=32, bits=4, class_predicate=quantize)
    eval_parameters(model)
    model.eval()
    return MlxAutoregressiveBinding(model, ByteTokenizer(), model_id="tiny-llama", config=config,
                                    weights_digest="3", cpu_kernels="native")


def assert_separate_layers_give_the_same_bits(binding: MlxAutoregressiveBinding) -> None:
    """A tiny model's forwards with its 2 layers fused, then again after `separate_layers`."""
    assert_fused(binding)
    prompt = make_prompt(23)
    fused = forwards(binding, prompt)
    assert native_layer.separate_layers(binding.model) == 2
    plain = forwards(binding, prompt)
    for got, want in zip(fused, plain, strict=True):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("bits", [{}, {"o_proj": (8, 64), "down_proj": (8, 128), "v_proj": (4, 32)},
                                  {"q_proj": (8, 32), "k_proj": (8, 32), "v_proj": (8, 32), "up_proj": (8, 64),
                                   "gate_proj": (8, 64)}])
def test_a_tiny_llama_with_other_quantizations_keeps_its_bits(bits: dict[str, tuple[int, int]]) -> None:
    assert_separate_layers_give_the_same_bits(tiny_llama(bits))


def test_a_tiny_qwen3_s_layers_norm_q_and_k_per_head_inside_the_node_with_the_same_bits() -> None:
    binding = make_tiny_binding("qwen3", seed=5, native=True)
    assert hasattr(getattr(binding.model, "model").layers[0].self_attn, "q_norm")
    assert_separate_layers_give_the_same_bits(binding)


def test_a_layer_the_node_does_not_serve_runs_its_separate_nodes() -> None:
    """q, k and v of different bits cannot run as one product: the layer keeps its own forward."""
    binding = tiny_llama({"k_proj": (8, 32)})
    layers: Any = getattr(binding.model, "model").layers
    assert not any(isinstance(layer, native_layer.NativeLayerMixin) for layer in layers)
    assert native_layer._fused_parts(layers[0]) is None


@pytest.mark.parametrize(("change", "message"), [
    ("weights", "21 arrays"),
    ("h", "one row of D features per row"),
    ("bits", "one entry per product"),
    ("norm", "norm weights must be float32 of shape (D,)"),
    ("rows", "each sequence needs at least one row"),
    ("head_norms", "head norm weights must be float32 of shape (head size,)"),
])
def test_bad_arguments_are_value_errors(change: str, message: str) -> None:
    from mlxkv_cpu_kernels import ops

    binding = tiny_llama({})
    layer: Any = getattr(binding.model, "model").layers[0]
    parts = native_layer._fused_parts(layer)
    assert parts is not None
    _, _, linears, quant = parts
    weights = [linear[name] for linear in linears for name in ("weight", "scales", "biases")]
    args: dict[str, Any] = {
        "h": mx.zeros((2, 1, 128)), "input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
        "eps": 1e-5, "weights": weights, "bits": [b for b, _ in quant], "group_sizes": [g for _, g in quant], "head_norms": [],
        "positions": mx.array([0], dtype=mx.int32), "buffers": [mx.zeros((1, 2, 8, 16)), mx.zeros((1, 2, 8, 16))],
        "rows": [2], "scale": 0.25,
    }
    if change == "weights":
        args["weights"] = weights[:-1]
    elif change == "h":
        args["h"] = mx.zeros((3, 1, 128))
    elif change == "bits":
        args["bits"] = args["bits"][:3]
    elif change == "norm":
        args["input_norm"] = mx.zeros((64,))
    elif change == "head_norms":
        args["head_norms"] = [mx.zeros((16,)), mx.zeros((8,))]
    else:
        args["rows"] = [0]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ops.decoder_layer(**args)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_bfloat16_model_is_widened_to_float32_and_runs_the_native_layer_ops(kind: str) -> None:
    """mlx-community directories ship bfloat16 norms and scales: on the native path they are widened
    (exactly) to float32, so the layer ops run natively, and the answer is that of the same model
    built in float32 from the same bfloat16 values."""
    def model(widen_first: bool) -> nn.Module:
        config = make_tiny_config(kind)
        mx.random.seed(3)
        built = build_model(config)
        _randomize(built, 3)
        built.set_dtype(mx.bfloat16)
        nn.quantize(built, group_size=32, bits=4)
        if widen_first:
            built.set_dtype(mx.float32)
        eval_parameters(built)
        built.eval()
        return built

    config = make_tiny_config(kind)
    narrow = MlxAutoregressiveBinding(model(False), ByteTokenizer(), model_id="t", config=config, cpu_kernels="native")
    wide = MlxAutoregressiveBinding(model(True), ByteTokenizer(), model_id="t", config=config, cpu_kernels="native")
    assert narrow.native_ops[0] == "activations float32/1" and narrow.native_ops[1:] == wide.native_ops
    assert "attention native/2" in narrow.native_ops and narrow.config_fingerprint != wide.config_fingerprint
    leaves: Any = tree_flatten(narrow.model.parameters())  # type: ignore[no-untyped-call]
    assert {v.dtype for _, v in leaves} <= {mx.float32, mx.uint32}
    prompt = make_prompt(9)
    for got, want in zip(forwards(narrow, prompt), forwards(wide, prompt), strict=True):
        np.testing.assert_array_equal(got, want)

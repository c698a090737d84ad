"""GGUF block types converted to MLX affine triples equal llama.cpp's reference dequantization
(`gguf.quants.dequantize`) exactly; Q6_K becomes that float32 itself. Small synthetic files."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from mlxkv_inference._mlx_lm import load_gguf_file
from mlxkv_inference.errors import ModelLoadError, UnsupportedModelError
from mlxkv_inference.models.embedded import embedded_model_path
from mlxkv_inference.models.gguf_quants import AFFINE_BITS, AffineWeight, convert_tensor
from mlxkv_inference.models.gguf_reader import _read_with_gguf, read_gguf

# Byte offsets of each block's float16 fields (d, and dmin or m where the type has one).
HALVES = {T.Q4_0: (0,), T.Q8_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
          T.Q6_K: (208,), T.Q2_K: (80, 82)}
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # gguf.quants can make these from floats


def random_blocks(kind: T, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Raw blocks of `kind` with random codes and scales (finite float16 scales): (rows, bytes)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, columns // block_size, type_size), dtype=np.uint8)
    for at in HALVES[kind]:
        raw[:, :, at : at + 2] = rng.normal(0, 0.02, (rows, columns // block_size, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, T]], architecture: str = "llama") -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized(weights: dict[str, mx.array], base: str) -> np.ndarray:
    """A tensor read by `read_gguf`, as float32 (`mx.dequantize` of a triple)."""
    w = weights[f"{base}.weight"]
    if w.dtype != mx.uint32:
        return np.array(w.astype(mx.float32))
    scales, biases = weights[f"{base}.scales"].astype(mx.float32), weights[f"{base}.biases"].astype(mx.float32)
    bits = w.shape[-1] * 32 // (scales.shape[-1] * 32)
    return np.array(mx.dequantize(w, scales, biases, group_size=32, bits=bits))


@pytest.mark.parametrize("kind", [*AFFINE_BITS, T.Q6_K], ids=lambda k: k.name)
def test_every_type_read_from_a_file_equals_the_reference_dequantization(kind: T, tmp_path: Path) -> None:
    blocks = random_blocks(kind, 6, 512)
    path = write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (blocks, kind)})
    weights, _ = read_gguf(path)
    reference = gguf.quants.dequantize(blocks, kind)
    assert reference.shape == (6, 512)
    got = dequantized(weights, "blk.0.ffn_up")
    assert np.array_equal(got, reference)  # exact, not close
    if kind in AFFINE_BITS:
        assert weights["blk.0.ffn_up.weight"].dtype == mx.uint32
        assert weights["blk.0.ffn_up.weight"].shape == (6, 512 * AFFINE_BITS[kind] // 32)
    else:
        assert weights["blk.0.ffn_up.weight"].dtype == mx.float32  # Q6_K: float32, the reference itself


@pytest.mark.parametrize("kind", QUANTIZABLE, ids=lambda k: k.name)
def test_blocks_quantized_from_floats_convert_exactly(kind: T) -> None:
    floats = np.random.default_rng(1).normal(0, 1, (4, 256)).astype(np.float32)
    blocks = gguf.quants.quantize(floats, kind)
    converted = convert_tensor(kind, blocks, (4, 256))
    assert isinstance(converted, AffineWeight)
    got = mx.dequantize(mx.array(converted.weight), mx.array(converted.scales), mx.array(converted.biases),
                        group_size=32, bits=converted.bits)
    assert np.array_equal(np.array(got), gguf.quants.dequantize(blocks, kind))


def test_k_quant_triples_run_through_mlx_quantized_matmul() -> None:
    blocks = random_blocks(T.Q5_K, 8, 256, seed=2)
    converted = convert_tensor(T.Q5_K, blocks, (8, 256))
    assert isinstance(converted, AffineWeight) and converted.bits == 5
    x = mx.random.normal((3, 256), key=mx.random.key(0))
    dense = x @ mx.array(gguf.quants.dequantize(blocks, T.Q5_K)).T
    got = mx.quantized_matmul(x, mx.array(converted.weight), mx.array(converted.scales), mx.array(converted.biases),
                              transpose=True, group_size=32, bits=5)
    assert mx.allclose(got, dense, rtol=1e-5, atol=1e-6).item()


def test_a_file_mlx_would_read_lossily_is_read_exactly(tmp_path: Path) -> None:
    # mx.load turns Q4_K into float16 without a word; the reader must not keep that.
    blocks = random_blocks(T.Q4_K, 4, 256, seed=3)
    path = write_gguf(tmp_path / "k.gguf", {"output.weight": (blocks, T.Q4_K)})
    assert load_gguf_file(str(path))[0]["output.weight"].dtype == mx.float16
    weights, _ = read_gguf(path)
    assert np.array_equal(dequantized(weights, "output"), gguf.quants.dequantize(blocks, T.Q4_K))


def test_an_unsupported_tensor_type_names_the_tensor_type_and_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "q2.gguf", {"blk.3.ffn_down.weight": (random_blocks(T.Q2_K, 2, 256), T.Q2_K)}, "gemma3")
    with pytest.raises(UnsupportedModelError, match=r"'blk\.3\.ffn_down\.weight' of architecture 'gemma3' has type Q2_K"):
        read_gguf(path)


def test_a_truncated_file_is_a_load_error(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", {"blk.0.attn_q.weight": (random_blocks(T.Q5_0, 64, 256), T.Q5_0)})
    data = path.read_bytes()
    for size in (len(data) // 2, 40, 3):
        path.write_bytes(data[:size])
        with pytest.raises(ModelLoadError):
            read_gguf(path)


def test_embedded_model_reads_the_same_through_mlx_and_through_gguf() -> None:
    # The embedded Q4_1 file keeps MLX's fast loader; gguf's reader gives the very same arrays.
    fast, metadata = read_gguf(embedded_model_path())
    slow, slow_metadata = _read_with_gguf(embedded_model_path())
    assert sorted(fast) == sorted(slow)
    for name, t in fast.items():  # scales and biases: float16 from MLX, float32 (the same values) from gguf
        assert mx.array_equal(t.astype(mx.float32), slow[name].astype(mx.float32)).item(), name
        assert t.dtype == slow[name].dtype or name.endswith((".scales", ".biases")), name
    assert list(slow_metadata["tokenizer.ggml.tokens"]) == list(metadata["tokenizer.ggml.tokens"])

"""GGUF quantized blocks -> MLX affine triples (w = scale * q + bias per group of 32), or float32.

A GGUF block maps onto MLX's affine quantization where all values of a group of 32 share one scale
and one offset: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (one block = one group), Q4_K and Q5_K (a super-block
of 256 = 8 groups of 32, scale = d * sc and bias = -dmin * m with 6-bit sc and m). The scales and
biases are float32 products of a float16 and a small integer, so they are exact, and so is every
dequantized value: `mx.dequantize` of the triple equals `gguf.quants.dequantize` of the block.

Q6_K scales groups of 16, which MLX's affine quantization cannot (group sizes 32, 64, 128): its
tensors become float32 through `gguf.quants.dequantize` itself (exact, ~4.9x the bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

__all__ = ["AFFINE_BITS", "DENSE_TYPES", "GROUP_SIZE", "AffineWeight", "convert_tensor", "pack_codes", "supported_type_names"]

GROUP_SIZE = 32
_T = GGMLQuantizationType
# Bits of the MLX triple each block type becomes.
AFFINE_BITS = {_T.Q4_0: 4, _T.Q4_1: 4, _T.Q5_0: 5, _T.Q5_1: 5, _T.Q8_0: 8, _T.Q4_K: 4, _T.Q5_K: 5}
# Types kept (or made) float32: the float types, and Q6_K (see the module docstring).
DENSE_TYPES = (_T.F32, _T.F16, _T.BF16, _T.Q6_K)

# Byte i of eight packed codes: (code, shift) pairs, the stream's bits 8i..8i+7.
_PACK_BYTES = {
    4: [[(0, 0), (1, 4)], [(2, 0), (3, 4)], [(4, 0), (5, 4)], [(6, 0), (7, 4)]],
    5: [[(0, 0), (1, 5)], [(1, -3), (2, 2), (3, 7)], [(3, -1), (4, 4)], [(4, -4), (5, 1), (6, 6)], [(6, -2), (7, 3)]],
}

Codes = tuple[np.ndarray, np.ndarray, np.ndarray]  # (codes uint8 (n, block), scales f32, biases f32 (n, groups))


@dataclass(frozen=True, slots=True)
class AffineWeight:
    """An MLX affine-quantized tensor: `weight` packs `bits`-bit codes into uint32 as MLX does."""

    weight: np.ndarray  # uint32 (..., columns * bits / 32)
    scales: np.ndarray  # float32 (..., columns / 32)
    biases: np.ndarray  # float32 (..., columns / 32)
    bits: int


def supported_type_names() -> list[str]:
    return sorted(t.name for t in (*AFFINE_BITS, *DENSE_TYPES))


def convert_tensor(kind: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, ...]) -> AffineWeight | np.ndarray:
    """The tensor of GGUF type `kind` whose raw blocks are `data` (as `gguf.GGUFReader` gives
    them), shaped `shape` (numpy order: the last axis is the one quantized along).

    Raises ValueError for a type without a conversion (`supported_type_names` lists them)."""
    if kind in DENSE_TYPES:
        dense: np.ndarray = dequantize(data, kind).astype(np.float32, copy=False)
        return dense.reshape(shape)
    if kind not in AFFINE_BITS:
        raise ValueError(f"GGUF tensor type {kind.name} has no conversion; supported: {', '.join(supported_type_names())}")
    block_size, type_size = GGML_QUANT_SIZES[kind]
    if shape[-1] % block_size:
        raise ValueError(f"a {kind.name} tensor's rows must hold whole blocks of {block_size}, got shape {shape}")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)
    codes, scales, biases = _UNPACK[kind](blocks)
    rows = shape[:-1]
    bits = AFFINE_BITS[kind]
    return AffineWeight(pack_codes(codes.reshape(*rows, shape[-1]), bits), scales.reshape(*rows, -1),
                        biases.reshape(*rows, -1), bits)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 `codes` (..., K), each < 2**bits, packed as MLX packs them: a little-endian stream of
    `bits`-bit fields, read as uint32 words (K * bits / 32 of them per row)."""
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8).view(np.uint32)
    if bits in _PACK_BYTES:
        return _pack_bytes(codes, bits)
    # Eight codes fill exactly `bits` bytes: assemble them in a uint64, keep its low bytes.
    eights = codes.reshape(*codes.shape[:-1], -1, 8).astype(np.uint64)
    word = np.zeros(eights.shape[:-1], dtype=np.uint64)
    for i in range(8):
        word |= eights[..., i] << np.uint64(bits * i)
    stream = word[..., None].view(np.uint8)[..., :bits]  # little-endian bytes of each word
    return np.ascontiguousarray(stream).reshape(*codes.shape[:-1], -1).view(np.uint32)


def _pack_bytes(codes: np.ndarray, bits: int) -> np.ndarray:
    """4 and 5 bits: each byte of the stream made from the codes it holds, in uint8 arithmetic
    (shifts past bit 7 fall off): ~5x faster than the uint64 words, and the same bytes."""
    eights = codes.reshape(*codes.shape[:-1], -1, 8).astype(np.uint8, copy=False)
    out = np.zeros((*eights.shape[:-1], bits), dtype=np.uint8)
    for byte, parts in enumerate(_PACK_BYTES[bits]):
        for code, shift in parts:  # shift > 0: code << shift; shift < 0: code >> -shift
            c = eights[..., code]
            out[..., byte] |= c << np.uint8(shift) if shift >= 0 else c >> np.uint8(-shift)
    return out.reshape(*codes.shape[:-1], -1).view(np.uint32)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block, as float32 (n, 1)."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Codes from 4-bit pairs: each run of `width` bytes holds `width` codes in its low nibbles,
    then the next `width` in its high nibbles."""
    runs = qs.reshape(qs.shape[0], -1, 1, width)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(qs.shape[0], -1)


def _high_bits_q5(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of the little-endian uint32 is code j's fifth bit."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


def _q8_0(blocks: np.ndarray) -> Codes:
    d = _half(blocks, 0)
    return blocks[:, 2:] ^ np.uint8(0x80), d, -128 * d  # int8 q as q + 128


def _q4_0(blocks: np.ndarray) -> Codes:
    d = _half(blocks, 0)
    return _nibbles(blocks[:, 2:], 16), d, -8 * d


def _q4_1(blocks: np.ndarray) -> Codes:
    return _nibbles(blocks[:, 4:], 16), _half(blocks, 0), _half(blocks, 2)


def _q5_0(blocks: np.ndarray) -> Codes:
    d = _half(blocks, 0)
    return _nibbles(blocks[:, 6:], 16) | _high_bits_q5(blocks[:, 2:6]), d, -16 * d


def _q5_1(blocks: np.ndarray) -> Codes:
    return _nibbles(blocks[:, 8:], 16) | _high_bits_q5(blocks[:, 4:8]), _half(blocks, 0), _half(blocks, 2)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 8 groups' scales d * sc and biases -dmin * m (float32, exact)."""
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return _half(blocks, 0) * sc.astype(np.float32), -(_half(blocks, 2) * m.astype(np.float32))


def _q4_k(blocks: np.ndarray) -> Codes:
    scales, biases = _k_scales(blocks)
    return _nibbles(blocks[:, 16:144], 32), scales, biases


def _q5_k(blocks: np.ndarray) -> Codes:
    scales, biases = _k_scales(blocks)
    # qh[l] bit s is the fifth bit of code l of group s.
    high = np.unpackbits(blocks[:, 16:48, None], axis=2, bitorder="little").transpose(0, 2, 1).reshape(len(blocks), -1)
    return _nibbles(blocks[:, 48:176], 32) | (high << 4), scales, biases


_UNPACK: dict[GGMLQuantizationType, Callable[[np.ndarray], Codes]] = {
    _T.Q8_0: _q8_0, _T.Q4_0: _q4_0, _T.Q4_1: _q4_1, _T.Q5_0: _q5_0, _T.Q5_1: _q5_1, _T.Q4_K: _q4_k, _T.Q5_K: _q5_k,
}

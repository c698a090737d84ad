"""Layers of bit widths the native kernel cannot read (5-bit Q5_0/Q5_K, 6, 3, 2) are re-packed as
8-bit codes holding exactly the same weights, and then run on the native kernel."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxkv_inference.native.kernels import NativeQuantizedLinear, use_native_kernels, widen_to_8_bits


class Two(nn.Module):
    def __init__(self, bits: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx leaves it untyped
        self.narrow = nn.QuantizedLinear(256, 64, bias=False, group_size=32, bits=bits)
        self.four = nn.QuantizedLinear(256, 64, bias=False, group_size=32, bits=4)


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_widened_layers_hold_the_same_weights_and_run_natively(bits: int) -> None:
    if sys.platform != "linux":
        pytest.skip("the native CPU kernels are Linux-only")
    model = Two(bits)
    layer = model.narrow
    before = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32, bits=bits)
    x = mx.random.normal((3, 256), key=mx.random.key(1))
    expected = layer(x)
    assert widen_to_8_bits(model) == 1  # the 4-bit layer is left as it is
    assert (model.narrow.bits, model.four.bits, model.narrow.weight.shape) == (8, 4, (64, 64))
    assert mx.array_equal(mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32, bits=8), before).item()
    assert use_native_kernels(model) == 2
    assert isinstance(model.narrow, NativeQuantizedLinear)
    assert mx.allclose(model.narrow(x), expected, rtol=1e-5, atol=1e-5).item()

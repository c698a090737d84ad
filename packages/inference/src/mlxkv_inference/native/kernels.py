"""Which kernels run a model's quantized matmuls on the CPU: MLX's own, or mlxkv's native one.

`native` swaps every supported `nn.QuantizedLinear` (and the tied lm_head, via
`QuantizedEmbedding.as_linear`) for a subclass calling mlxkv-cpu-kernels' batch-invariant,
multi-threaded quantized matmul. `mlx` leaves the model untouched (today's path, equal to mlx-lm).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["CPU_KERNELS", "FLOAT32_ACTIVATIONS", "WIDENED_TO_8_BITS", "CpuKernels", "default_cpu_kernels", "describe_cpu_kernels",
           "float32_activations", "project", "use_float32_parameters", "use_native_kernels", "widen_to_8_bits"]

CpuKernels = Literal["native", "mlx"]
CPU_KERNELS: tuple[CpuKernels, ...] = ("native", "mlx")

_BITS = (4, 8)
_WIDENED_BITS = (2, 3, 5, 6)  # codes the kernel cannot read, which fit 8-bit codes as they are
# What the config fingerprint records when layers were widened (the kernel sums their products
# in its own order, so their outputs are not MLX's 5-bit kernel's bits).
WIDENED_TO_8_BITS = "quantized widened to 8 bits/1"
_GROUP_SIZES = (32, 64, 128)


def native_kernels_available() -> bool:
    """True on Linux with mlxkv-cpu-kernels installed and its extension importable."""
    if sys.platform != "linux" or importlib.util.find_spec("mlxkv_cpu_kernels") is None:
        return False
    try:
        import mlxkv_cpu_kernels.ops  # noqa: F401
    except ImportError:
        return False
    return True


def default_cpu_kernels() -> CpuKernels:
    return "native" if native_kernels_available() else "mlx"


def check_cpu_kernels(choice: str) -> CpuKernels:
    """Validates a --cpu-kernels value; raises ValueError with advice."""
    if choice not in CPU_KERNELS:
        raise ValueError(f"cpu kernels {choice!r} unknown; choose one of {', '.join(CPU_KERNELS)}")
    if choice == "native" and not native_kernels_available():
        raise ValueError("cpu kernels 'native' need Linux with mlxkv-cpu-kernels built and importable; use 'mlx'")
    return choice


def describe_cpu_kernels(choice: CpuKernels) -> str:
    """For start-up logs and /health, e.g. `native (avx512, 2 threads)`."""
    if choice == "mlx":
        return "mlx"
    from mlxkv_cpu_kernels import ops

    return f"native ({ops.isa()}, {ops.num_threads()} threads)"


# What the config fingerprint records when a model's float parameters were widened to float32.
FLOAT32_ACTIVATIONS = "activations float32/1"


def use_float32_parameters(model: nn.Module) -> bool:
    """Widens `model`'s bfloat16/float16 parameters (norms, biases, quantization scales and biases,
    unquantized weights) to float32, in place, so its activations are float32, the only dtype the
    native kernels take and the fast one on MLX's CPU backend (as GGUF files are loaded); returns
    whether any changed. A bfloat16 mlx-lm directory otherwise runs none of the native layer ops,
    and MLX's CPU backend is slow on bfloat16 itself. Quantized codes (uint32) stay as they are."""
    leaves: Any = tree_flatten(model.parameters())  # type: ignore[no-untyped-call]  # mlx leaves it untyped
    narrow = [v for _, v in leaves if v.dtype in (mx.bfloat16, mx.float16)]
    if narrow:
        model.set_dtype(mx.float32)
    return bool(narrow)


def float32_activations(model: nn.Module) -> bool:
    """Whether `model`'s hidden states are float32 (its embedding's output), the only dtype the
    native attention and elementwise kernels take."""
    embed: Any = getattr(getattr(model, "model", None), "embed_tokens", None)
    return embed is not None and embed(mx.array([[0]])).dtype == mx.float32


def widen_to_8_bits(model: nn.Module) -> int:
    """Re-packs the codes of affine layers of 2, 3, 5 or 6 bits as 8-bit codes with the same scales
    and biases, in place, so the native kernel serves them: the same weight values exactly (a
    code below 32 is the same number in 8 bits), 8/5 the bytes of a 5-bit layer. Gemma 3 270M's
    Q5_0 layers on MLX's 5-bit kernel made its prefill several times slower than the rest.
    Returns how many layers were widened."""
    widened = 0
    for _, module in model.named_modules():  # type: ignore[no-untyped-call]  # mlx leaves it untyped
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding) and module.bits in _WIDENED_BITS \
                and getattr(module, "mode", "affine") == "affine" and module.get("biases") is not None:
            scales = module["scales"]
            codes = mx.dequantize(module["weight"], mx.ones_like(scales), mx.zeros_like(scales),
                                  group_size=module.group_size, bits=module.bits)
            module["weight"] = codes.astype(mx.uint8).view(mx.uint32)
            module.bits = 8
            widened += 1
    return widened


def use_native_kernels(model: nn.Module) -> int:
    """Swaps supported quantized layers for native ones in place; returns how many were swapped."""
    from mlxkv_cpu_kernels import ops  # noqa: F401  (fail here, at load, if the build is broken)

    swaps: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():  # type: ignore[no-untyped-call]  # mlx leaves it untyped
        if isinstance(module, nn.QuantizedLinear) and _supported(module):
            swaps.append((path, _copy_into(NativeQuantizedLinear, module)))
        elif isinstance(module, nn.QuantizedEmbedding) and _supported(module):
            swaps.append((path, _copy_into(NativeQuantizedEmbedding, module)))
    model.update_modules(tree_unflatten(swaps), strict=False)
    return len(swaps)


class NativeQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose matmul is the native kernel (same parameters, same layout)."""

    def __call__(self, x: mx.array) -> mx.array:
        return _native_outputs([self], x)[0]


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose tied-output projection is the native kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        return _native_outputs([self], x)[0]


def _native_outputs(layers: Sequence[nn.Module], x: mx.array) -> list[mx.array]:
    """Each native layer (one kind: bits, group size, scales dtype) applied to `x`, in one kernel
    call, with its bias where it has one."""
    from mlxkv_cpu_kernels import ops

    # NOTE: the kernel takes float32 activations (the fast CPU dtype); other dtypes round-trip.
    x32, first = x.astype(mx.float32), layers[0]
    if len(layers) == 1:
        ys = [ops.quantized_matmul(x32, first["weight"], first["scales"], first["biases"], first.group_size, first.bits)]
    else:
        ys = ops.quantized_matmuls(x32, [layer["weight"] for layer in layers], [layer["scales"] for layer in layers],
                                   [layer["biases"] for layer in layers], first.group_size, first.bits)
    out = []
    for layer, y in zip(layers, ys, strict=True):
        y = y if x.dtype == mx.float32 else y.astype(x.dtype)
        out.append(y + layer["bias"] if "bias" in layer else y)
    return out


def project(x: mx.array, layers: Sequence[nn.Module]) -> list[mx.array]:
    """Each of `layers` applied to the same `x` (a layer's q, k and v projections, or its gate and
    up). Native layers of one kind (bits, group size, scales dtype) run as one kernel call: one
    hand-off to the kernels' threads instead of one per layer (what it saves: docs/benchmarks.md,
    native kernels), and each output has the bits its own call gives. Other layers (MLX's
    kernel, adapters) are called one by one."""
    if len(layers) < 2:
        return [layer(x) for layer in layers]
    first = layers[0]
    if not all(
        isinstance(layer, NativeQuantizedLinear) and layer.bits == first.bits and layer.group_size == first.group_size
        and layer["scales"].dtype == first["scales"].dtype
        for layer in layers
    ):
        return [layer(x) for layer in layers]
    return _native_outputs(layers, x)


def _supported(module: nn.Module) -> bool:
    scales = module.get("scales")
    return (
        getattr(module, "mode", "affine") == "affine"
        and module.get("biases") is not None
        and module.bits in _BITS
        and module.group_size in _GROUP_SIZES
        and scales is not None
        and scales.dtype in (mx.float32, mx.float16)
    )


def _copy_into(cls: type[nn.Module], source: nn.Module) -> nn.Module:
    # Same attributes and parameters, new class: no re-quantization, no copy of the arrays.
    module = cls.__new__(cls)
    module.__dict__.update(source.__dict__)
    dict.update(module, source)
    return module

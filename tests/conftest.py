"""Shared fixtures. The embedded model is loaded once per session (it takes seconds)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator

import pytest

# Nothing the tests run (in process or as a subprocess) may touch the user's own cache directory.
os.environ["MLXKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="mlxkv-test-cache-")

from mlxkv_inference import MlxAutoregressiveBinding, load_binding


@pytest.fixture(scope="session")
def embedded() -> MlxAutoregressiveBinding:
    """The real embedded SmolLM2-135M-Instruct model (tests using it are named `..._embedded_...`).

    On MLX's own kernels (`cpu_kernels="mlx"`): the tests comparing with mlx-lm token for token
    are about that path. `embedded_native` is the same model on the native kernels.
    """
    return load_binding(cpu_kernels="mlx")


@pytest.fixture(scope="session")
def embedded_native() -> MlxAutoregressiveBinding:
    """The embedded model on mlxkv-cpu-kernels' native quantized matmul (Linux only)."""
    if sys.platform != "linux":
        pytest.skip("the native CPU kernels are Linux-only")
    return load_binding(cpu_kernels="native")


@pytest.fixture
def restore_threads_and_isa() -> Iterator[None]:
    """Puts the native kernels' thread count and instruction set back after a test that sets them."""
    from mlxkv_cpu_kernels import ops

    threads, isa = ops.num_threads(), ops.isa()
    yield
    ops.set_num_threads(threads)
    ops.set_isa(isa)

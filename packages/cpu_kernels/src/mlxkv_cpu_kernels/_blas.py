"""Route MLX's float GEMMs (cblas_sgemm/dgemm/cgemm) to numpy's bundled OpenBLAS.

libmlx links a reference BLAS (~4 GFLOP/s). A shim exporting the standard cblas names, loaded
into the global symbol scope before libmlx, wins symbol resolution and forwards to numpy's
OpenBLAS (prefixed `scipy_` symbols, 64-bit integers). Pure Python: imports neither mlx nor numpy.
"""

import ctypes
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BlasStatus", "blas_status", "load_blas"]

_log = logging.getLogger(__name__)
_SHIM = Path(__file__).with_name("libmlxkv_blas_shim.so")


@dataclass(frozen=True, slots=True)
class BlasStatus:
    """Which BLAS serves MLX's float matmuls in this process."""

    name: str  # "numpy-openblas" or "mlx-reference"
    detail: str

    def describe(self) -> str:
        return f"{self.name} ({self.detail})"


_status: BlasStatus | None = None


def load_blas() -> BlasStatus:
    """Install the shim once per process; returns what MLX's float matmuls will use."""
    global _status
    if _status is None:
        _status = _load()
    return _status


def blas_status() -> BlasStatus:
    return load_blas()


def _load() -> BlasStatus:
    if "mlx.core" in sys.modules:
        _log.warning("mlx was imported before mlxkv_cpu_kernels.load_blas(); float matmuls keep MLX's reference BLAS")
        return BlasStatus("mlx-reference", "mlx imported before the shim")
    openblas = _numpy_openblas()
    if openblas is None:
        return BlasStatus("mlx-reference", "numpy's bundled OpenBLAS not found")
    if not _SHIM.exists():
        return BlasStatus("mlx-reference", f"{_SHIM.name} not built")
    shim = ctypes.CDLL(str(_SHIM), mode=ctypes.RTLD_GLOBAL)
    if shim.mlxkv_blas_bind(str(openblas).encode()) != 0:
        return BlasStatus("mlx-reference", f"{openblas.name} lacks the scipy_cblas_*64_ symbols")
    threads = cpu_threads()
    shim.mlxkv_blas_set_threads(threads)
    return BlasStatus("numpy-openblas", f"{openblas.name}, {threads} threads")


def cpu_threads() -> int:
    """MLXKV_CPU_THREADS, else the number of cores (shared by the BLAS and the native kernel)."""
    value = os.environ.get("MLXKV_CPU_THREADS", "")
    if value.strip().isdigit() and int(value) > 0:
        return int(value)
    return os.cpu_count() or 1


def _numpy_openblas() -> Path | None:
    spec = importlib.util.find_spec("numpy")
    if spec is None or spec.origin is None:
        return None
    libs = Path(spec.origin).parent.parent / "numpy.libs"
    found = sorted(libs.glob("libscipy_openblas64_*.so"))
    return found[0] if found else None

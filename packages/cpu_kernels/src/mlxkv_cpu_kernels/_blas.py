"""Replace MLX's reference BLAS for float32 matmuls (cblas_sgemm) with mlxkv's fixed-order one.

libmlx links a reference BLAS (~4 GFLOP/s). A library exporting `cblas_sgemm`, loaded into the
global symbol scope before libmlx, wins symbol resolution. NOTE: not numpy's OpenBLAS, though
faster: it picks kernels by shape, so a token's attention scores changed in the last bits with
the prefill chunk or the compiled step. The shim reduces every element in the native kernel's
fixed order. Pure Python: imports neither mlx nor numpy.
"""

import ctypes
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BlasStatus", "blas_status", "load_blas", "split_blas_products"]

_log = logging.getLogger(__name__)
_SHIM = Path(__file__).with_name("libmlxkv_blas_shim.so")


@dataclass(frozen=True, slots=True)
class BlasStatus:
    """Which BLAS serves MLX's float32 matmuls in this process."""

    name: str  # "mlxkv-sgemm" or "mlx-reference"
    detail: str

    def describe(self) -> str:
        return f"{self.name} ({self.detail})"


_status: BlasStatus | None = None
_shim: ctypes.CDLL | None = None


def load_blas() -> BlasStatus:
    """Install the shim once per process; returns what MLX's float32 matmuls will use."""
    global _status
    if _status is None:
        _status = _load()
    return _status


def blas_status() -> BlasStatus:
    """What serves MLX's float32 matmuls now: large products run on the native kernels' threads
    once their extension (`mlxkv_cpu_kernels.ops`) has loaded."""
    status = load_blas()
    if status.name == "mlxkv-sgemm" and _shim is not None:
        threads = "the native kernels' threads" if _shim.mlxkv_blas_has_runner() else "one thread"
        return BlasStatus(status.name, f"{status.detail}, large products on {threads}")
    return status


def _load() -> BlasStatus:
    if "mlx.core" in sys.modules:
        _log.warning("mlx was imported before mlxkv_cpu_kernels.load_blas(); float matmuls keep MLX's reference BLAS")
        return BlasStatus("mlx-reference", "mlx was imported before the shim")
    if not _SHIM.exists():
        return BlasStatus("mlx-reference", f"{_SHIM.name} not built")
    global _shim
    _shim = ctypes.CDLL(str(_SHIM), mode=ctypes.RTLD_GLOBAL)
    return BlasStatus("mlxkv-sgemm", "fixed-order cblas_sgemm")


def split_blas_products(enabled: bool) -> bool:
    """Whether the shim splits large float products over the native kernels' threads (on by
    default; a split changes which thread computes an element, never how); returns the previous
    setting. False where the shim is not loaded."""
    if load_blas().name != "mlxkv-sgemm" or _shim is None:
        return False
    return bool(_shim.mlxkv_blas_set_split(ctypes.c_int(int(enabled))))

"""Native CPU kernels for mlxkv on Linux.

Importing this package loads nothing native: `load_blas` must run before mlx is first imported,
so the kernel itself lives in `mlxkv_cpu_kernels.ops` (which imports mlx).
"""

from mlxkv_cpu_kernels._blas import BlasStatus, blas_status, load_blas, split_blas_products

__all__ = ["BlasStatus", "blas_status", "load_blas", "split_blas_products"]

"""Route MLX's float matmuls to an optimized BLAS on Linux (must run before mlx is imported)."""

import importlib.util

__all__ = ["blas_description", "load_native_blas"]

_REFERENCE = "mlx-reference (mlxkv-cpu-kernels not installed)"


def load_native_blas() -> None:
    """Installs the mlxkv-cpu-kernels BLAS shim where that package is installed (Linux)."""
    if importlib.util.find_spec("mlxkv_cpu_kernels") is not None:
        import mlxkv_cpu_kernels

        mlxkv_cpu_kernels.load_blas()


def blas_description() -> str:
    """What serves MLX's float matmuls in this process, for start-up logs and /health."""
    if importlib.util.find_spec("mlxkv_cpu_kernels") is None:
        return _REFERENCE
    import mlxkv_cpu_kernels

    return mlxkv_cpu_kernels.blas_status().describe()

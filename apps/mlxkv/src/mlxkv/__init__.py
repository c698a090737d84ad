"""mlxkv: the command line and the wiring of the inference, state, SSD cache and serve packages."""

# NOTE: first, before mlxkv_state (which imports mlx) can run: importing mlxkv_inference installs
# the BLAS shim, which only takes effect when loaded ahead of libmlx.
import mlxkv_inference  # noqa: F401

__version__ = "0.1.0"

"""mlxkv_serve."""

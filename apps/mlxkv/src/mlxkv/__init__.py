"""mlxkv."""

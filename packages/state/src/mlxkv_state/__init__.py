"""mlxkv_state."""

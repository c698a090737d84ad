"""mlxkv_ssd_cache."""

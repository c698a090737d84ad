"""Subcommands of the mlxkv CLI."""

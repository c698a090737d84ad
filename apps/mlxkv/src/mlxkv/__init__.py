"""mlxkv: the command line and the wiring of the inference, state, SSD cache and serve packages."""

__version__ = "0.1.0"

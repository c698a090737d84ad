"""Named exceptions for faults outside the caller's control (files, formats)."""


class ModelLoadError(RuntimeError):
    """A model file or directory could not be loaded."""


class UnsupportedModelError(ModelLoadError):
    """The model uses an architecture, tensor type or feature mlxkv does not support."""

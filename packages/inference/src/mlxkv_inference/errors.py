"""Named exceptions for faults outside the caller's control (files, formats)."""


class ModelLoadError(RuntimeError):
    """A model file or directory could not be loaded."""


class UnsupportedModelError(ModelLoadError):
    """The model uses an architecture, tensor type or feature mlxkv does not support."""


class AdapterLoadError(RuntimeError):
    """An adapter directory could not be read: a missing or corrupt config or safetensors file."""


class AdapterMismatchError(ValueError):
    """An adapter does not fit the base model it is applied to (its modules or shapes differ)."""

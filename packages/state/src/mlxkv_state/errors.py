"""Faults in persisted KV state: raised by the codecs and the header parser."""


class StateError(Exception):
    """Base of every error this package raises for bad persisted data."""


class HeaderFormatError(StateError):
    """A KV file header is malformed (missing field, wrong type, unknown version)."""


class UnpersistableCacheError(StateError):
    """A cache has no codec for its signature: it is never written, nothing falls back."""


class CodecMismatchError(StateError):
    """Tensors read back do not fit the header entry (missing slot, wrong shape or dtype)."""

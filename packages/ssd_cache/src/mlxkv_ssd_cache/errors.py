"""Faults in KV files on disk. The store turns each of them into a miss (and a quarantine)."""

from mlxkv_state.errors import StateError


class KvFileError(StateError):
    """Base for every fault reading a KV file."""


class NotAKvFileError(KvFileError):
    """The file does not start with the KV file magic."""


class VersionMismatchError(KvFileError):
    """The container or header version is one this build does not read."""


class ShortReadError(KvFileError):
    """The file ends before a part the header promises (truncated write)."""


class ChecksumMismatchError(KvFileError):
    """The header's or a slot's bytes do not match their checksum."""


class SlotDecodeError(KvFileError):
    """A slot's bytes cannot be turned back into its tensor (decompression, size, dtype)."""

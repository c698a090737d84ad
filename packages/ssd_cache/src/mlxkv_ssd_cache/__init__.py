"""mlxkv SSD cold tier: the KV file container and the on-disk prompt store."""

from mlxkv_ssd_cache.container import CONTAINER_VERSION, MAGIC
from mlxkv_ssd_cache.errors import (
    ChecksumMismatchError, KvFileError, NotAKvFileError, ShortReadError, SlotDecodeError, VersionMismatchError,
)
from mlxkv_ssd_cache.kv_file import Attachments, KvIdentity, read_file, read_header, write_file_atomically
from mlxkv_ssd_cache.slot_codec import SlotPolicy
from mlxkv_ssd_cache.store import DEFAULT_CHECKPOINT_TTL_S, CacheHit, RestoredState, SsdCacheStore, StoreStats

__all__ = [
    "CONTAINER_VERSION",
    "DEFAULT_CHECKPOINT_TTL_S",
    "MAGIC",
    "Attachments",
    "CacheHit",
    "ChecksumMismatchError",
    "KvFileError",
    "KvIdentity",
    "NotAKvFileError",
    "RestoredState",
    "ShortReadError",
    "SlotDecodeError",
    "SlotPolicy",
    "SsdCacheStore",
    "StoreStats",
    "VersionMismatchError",
    "read_file",
    "read_header",
    "write_file_atomically",
]

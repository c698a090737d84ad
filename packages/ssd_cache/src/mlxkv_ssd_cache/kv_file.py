"""Whole-file operations: write a prompt state atomically, read one back completely."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlxkv_inference.cache.factory import LayerCache
from mlxkv_state.codecs import CODEC_PROVIDER, decode_caches, encode_caches
from mlxkv_state.errors import StateError
from mlxkv_state.header import GenerationCheckpoint, KvFileHeader
from mlxkv_ssd_cache.container import EncodedAttachment, FileContents, file_size, read_kv_header, read_kv_tensors, write_kv_file
from mlxkv_ssd_cache.errors import KvFileError
from mlxkv_ssd_cache.slot_codec import SlotPolicy

FILE_MODE = 0o600


@dataclass(frozen=True, slots=True)
class KvIdentity:
    """Whose KV this is: a file is only ever restored under the identity that wrote it."""

    model_id: str
    tokenizer_hash: str
    config_fingerprint: str


@dataclass(frozen=True, slots=True)
class Attachments:
    """Companion tensors: name -> (schema, tensors by name)."""

    groups: dict[str, tuple[str, dict[str, mx.array]]]


def build_header(
    identity: KvIdentity, tokens: Sequence[int], ns: str, checkpoint: GenerationCheckpoint | None
) -> KvFileHeader:
    return KvFileHeader(
        caches=(),
        tokens=tuple(tokens),
        model_id=identity.model_id,
        ns=ns,
        tokenizer_hash=identity.tokenizer_hash,
        config_fingerprint=identity.config_fingerprint,
        codec_provider=CODEC_PROVIDER,
        created_at=time.time(),
        generation_checkpoint=checkpoint,
    )


def identity_problem(identity: KvIdentity, header: KvFileHeader, ns: str, tokens: Sequence[int]) -> str | None:
    """Why a file read back may not serve `identity` (namespace `ns`, `tokens`), or None."""
    for field, have, want in (
        ("model id", header.model_id, identity.model_id),
        ("tokenizer hash", header.tokenizer_hash, identity.tokenizer_hash),
        ("config fingerprint", header.config_fingerprint, identity.config_fingerprint),
        ("namespace", header.ns, ns),
    ):
        if have != want:
            return f"{field} {have!r} is not {want!r}"
    if header.tokens != tuple(tokens):
        return "tokens differ from the index"
    return None


def expected_file_bytes(caches: Sequence[LayerCache]) -> int:
    """About what a file of `caches` takes (raw tensor bytes of the tokens they hold)."""
    total = 0
    for cache in caches:
        per_token = cache.bytes_per_token()
        total += min(cache.nbytes, per_token * cache.offset) if per_token else cache.nbytes
    return total


def write_file_atomically(
    path: Path,
    header: KvFileHeader,
    caches: Sequence[LayerCache],
    attachments: Attachments | None = None,
    policy: SlotPolicy = SlotPolicy(),
) -> KvFileHeader:
    """tmp file -> fsync -> rename -> fsync(dir): readers see the whole file or nothing.

    Raises `OSError` (disk full, permissions) or `UnpersistableCacheError`; the tmp file is
    removed on any failure.
    """
    encoded = encode_caches(caches)
    extra = [EncodedAttachment(n, s, tuple(t.items())) for n, (s, t) in (attachments.groups.items() if attachments else ())]
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as out:
            written = write_kv_file(out, header, encoded, extra, policy)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return written


def read_file(path: Path) -> tuple[KvFileHeader, list[LayerCache], Attachments]:
    """Read and decode a whole file; raises `StateError` subclasses for every data fault."""
    with path.open("rb", buffering=0) as f:
        header, data_start = read_kv_header(f)
        contents: FileContents = read_kv_tensors(f, header, data_start, file_size(f))
    try:
        caches = decode_caches(header.caches, contents.caches)
    except (ValueError, TypeError) as e:
        raise KvFileError(f"cache entries do not decode: {e}") from e
    # NOTE: evaluate here: MLX streams are per thread, and a restore may run on an I/O thread
    # while the arrays are used on the generation thread.
    mx.eval([c.state for c in caches], [list(t.values()) for _, t in contents.attachments.values()])
    return header, caches, Attachments(contents.attachments)


def read_header(path: Path) -> tuple[KvFileHeader, bool]:
    """The header and whether the file is long enough for every slot it lists."""
    with path.open("rb") as f:
        header, data_start = read_kv_header(f)
        size = file_size(f)
    slots = [s for c in header.caches for s in c.slots] + [s for a in header.attachments for s in a.slots]
    end = max((s.offset + s.stored_bytes for s in slots), default=0)
    return header, data_start + end <= size


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["Attachments", "KvIdentity", "StateError", "build_header", "read_file", "read_header", "write_file_atomically"]

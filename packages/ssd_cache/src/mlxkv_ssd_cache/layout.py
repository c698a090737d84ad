"""Where the store keeps each file: every part of identity the restore guard checks is in the path.

    <directory>/<identity key>/<ns key>/<entry id>.mlxkv          prompt states and objects
    <directory>/<identity key>/checkpoints/<request key>.mlxkv    generation checkpoints
    <directory>/<identity key>/quarantine/<name>.mlxkv            files that failed to read

    identity key = sha256(model id, tokenizer hash, config fingerprint)[:32]
    ns key       = "base" for the base model, "ns-" + sha256(ns)[:16] for an adapter namespace
    entry id     = sha256(ns, tokens)[:32], or "obj-" + sha256(ns, object key)[:28]

So two identities never write, evict or delete each other's files, even when they share a
config fingerprint (a byte-identical copy of a model under another name).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from mlxkv_state.header import KvFileHeader
from mlxkv_ssd_cache.kv_file import KvIdentity

SUFFIX = ".mlxkv"
DIR_MODE = 0o700
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_KEY_PREFIX = "ckpt-"  # a checkpoint's key in the store's index (never a file name)
QUARANTINE_DIR = "quarantine"
OBJECT_ATTACHMENT = "object"  # an object file: no tokens, one attachment whose schema is its key


def identity_key(identity: KvIdentity) -> str:
    parts = (identity.model_id, identity.tokenizer_hash, identity.config_fingerprint)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def entry_id(ns: str, tokens: Sequence[int]) -> str:
    digest = hashlib.sha256(ns.encode() + b"\0" + b",".join(str(t).encode() for t in tokens))
    return digest.hexdigest()[:32]


def object_id(ns: str, key: str) -> str:
    return "obj-" + hashlib.sha256(ns.encode() + b"\0" + key.encode()).hexdigest()[:28]


def expected_id(header: KvFileHeader) -> str:
    """The entry id a prompt or object file must be named after (a renamed file is not ours)."""
    objects = [a for a in header.attachments if a.name == OBJECT_ATTACHMENT]
    if not header.tokens and len(objects) == 1:
        return object_id(header.ns, objects[0].schema)
    return entry_id(header.ns, header.tokens)


def ns_key(ns: str) -> str:
    return "base" if ns == "" else "ns-" + hashlib.sha256(ns.encode()).hexdigest()[:16]


def make_private_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer can still put on `path`'s filesystem."""
    return shutil.disk_usage(path).free

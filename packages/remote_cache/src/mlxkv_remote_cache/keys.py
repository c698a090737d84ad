"""Where an entry lives in the shared store: keys derived only from content, never from a replica.

    mlxkv-kv1/<identity key>/<ns key>/<entry id>/manifest         commit point, written last
    mlxkv-kv1/<identity key>/<ns key>/<entry id>/<writer>/<i>     the entry's bytes, part i
    mlxkv-kv1/<identity key>/checkpoints/<request key>/latest     the newest version's name (moves)
    mlxkv-kv1/<identity key>/checkpoints/<request key>/<version>/manifest, .../<version>/<writer>/<i>
    mlxkv-kv1/<identity key>/events                               index changes (stores with a log)

identity key, ns key and entry id are the SSD store's (mlxkv_ssd_cache.layout): a remote entry holds
exactly the bytes of the SSD file of the same name. Parts sit under their writer's token, so two
replicas racing on one entry never mix their parts; the manifest that wins names its own.
"""

from __future__ import annotations

from mlxkv_ssd_cache.container import CONTAINER_VERSION

ROOT = f"mlxkv-kv{CONTAINER_VERSION}"
MANIFEST = "manifest"
CHECKPOINTS = "checkpoints"
LATEST = "latest"


def identity_prefix(identity_key: str) -> str:
    return f"{ROOT}/{identity_key}/"


def entry_prefix(identity_key: str, ns_key: str, entry_id: str) -> str:
    return f"{identity_prefix(identity_key)}{ns_key}/{entry_id}/"


def checkpoint_prefix(identity_key: str, request_key: str) -> str:
    return f"{identity_prefix(identity_key)}{CHECKPOINTS}/{request_key}/"


def events_channel(identity_key: str) -> str:
    return identity_prefix(identity_key) + "events"


def part_key(base: str, writer: str, index: int) -> str:
    return f"{base}{writer}/{index}"


def is_prompt_manifest(identity_key: str, key: str) -> bool:
    """Whether `key` is the manifest of a prompt entry of this identity (not a checkpoint's)."""
    rest = key.removeprefix(identity_prefix(identity_key)).split("/")
    return key.startswith(identity_prefix(identity_key)) and len(rest) == 3 and rest[2] == MANIFEST and rest[0] != CHECKPOINTS

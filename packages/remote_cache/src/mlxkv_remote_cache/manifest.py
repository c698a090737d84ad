"""An entry's manifest: what its parts are, and what the entry is (for the index mirror).

Written after every part, so a reader that finds it finds a complete entry unless a part was
evicted since (then a part is absent or fails its digest: a miss). Read back, every field is
checked before anything else is read: a manifest is remote bytes like any other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from mlxkv_remote_cache.errors import RemoteObjectError

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 8 << 20  # a 1M-token prompt's ids fit
Kind = Literal["prompt", "checkpoint"]


@dataclass(frozen=True, slots=True)
class Manifest:
    kind: Kind
    name: str  # the entry id (prompt) or the request key (checkpoint)
    ns: str
    tokens: tuple[int, ...]
    minimum_reusable_offset: int
    trimmable: bool
    size: int
    part_sizes: tuple[int, ...]
    part_digests: tuple[str, ...]  # xxh3-128 hex of each part
    sha256: str | None  # of the whole entry, in signed manifests
    writer: str  # the writing replica's token; its parts sit under it
    created_at: float
    signature: str | None = None  # HMAC-SHA256 of the rest, with the shared key

    def encode(self) -> bytes:
        return json.dumps({"version": MANIFEST_VERSION, **asdict(self)}, separators=(",", ":")).encode()

    def signed(self, key: bytes) -> Manifest:
        return replace(self, signature=_mac(key, self))

    def signature_ok(self, key: bytes) -> bool:
        return self.signature is not None and self.sha256 is not None and hmac.compare_digest(self.signature, _mac(key, self))


def decode_manifest(data: bytes, max_entry_bytes: int, max_part_bytes: int) -> Manifest:
    """The manifest in `data`; `RemoteObjectError` for anything malformed or over the limits."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RemoteObjectError(f"manifest is not JSON: {e}") from e
    if not isinstance(raw, dict) or raw.pop("version", None) != MANIFEST_VERSION:
        raise RemoteObjectError("manifest of an unknown version")
    try:
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        manifest = Manifest(**fields)
    except TypeError as e:
        raise RemoteObjectError(f"manifest fields: {e}") from e
    problem = _problem(manifest, max_entry_bytes, max_part_bytes)
    if problem:
        raise RemoteObjectError(f"manifest of {str(raw.get('name'))[:40]!r}: {problem}")
    return manifest


def _problem(m: Manifest, max_entry_bytes: int, max_part_bytes: int) -> str | None:
    checks: list[tuple[bool, str]] = [
        (m.kind in ("prompt", "checkpoint"), f"kind {m.kind!r}"),
        (_is_hex(m.name) and _is_hex(m.writer), "name or writer is not hex"),
        (isinstance(m.ns, str) and _all(m.tokens, int) and _all(m.part_digests, str), "field types"),
        (_all(m.part_sizes, int) and all(0 < s <= max_part_bytes for s in m.part_sizes), "a part size outside the limit"),
        (isinstance(m.size, int) and 0 < m.size <= max_entry_bytes and sum(m.part_sizes) == m.size, "size"),
        (len(m.part_sizes) == len(m.part_digests), "parts and digests differ in number"),
        (isinstance(m.minimum_reusable_offset, int) and isinstance(m.trimmable, bool), "reuse fields"),
        (m.sha256 is None or _is_hex(m.sha256), "sha256"),
        (m.signature is None or isinstance(m.signature, str), "signature"),
        (isinstance(m.created_at, (int, float)), "created_at"),
    ]
    return next((why for ok, why in checks if not ok), None)


def _mac(key: bytes, m: Manifest) -> str:
    return hmac.new(key, replace(m, signature=None).encode(), hashlib.sha256).hexdigest()


def _is_hex(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 128 and all(c in "0123456789abcdef" for c in value)


def _all(values: Any, kind: type) -> bool:
    return isinstance(values, tuple) and all(isinstance(v, kind) and not isinstance(v, bool) for v in values)

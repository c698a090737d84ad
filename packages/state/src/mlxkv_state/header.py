"""KV file header types: what one persisted prompt state is, and whose it is.

Every value is a frozen dataclass; `to_json` / `from_json` round-trip them through plain JSON
types, and `from_json` validates what it reads (it parses data from disk).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mlxkv_state.errors import HeaderFormatError

FORMAT_VERSION = 1
SLOT_CODECS = ("raw", "zstd", "shuffle+zstd")


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """One tensor stored in the file: where its (possibly compressed) bytes are and what they hold."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str  # one of SLOT_CODECS
    level: int
    offset: int  # from the start of the data section
    stored_bytes: int
    raw_bytes: int
    checksum: int  # xxh3-64 of the stored bytes


@dataclass(frozen=True, slots=True)
class CacheHeaderEntry:
    """One layer's cache: its kind, positions, kind parameters and tensor slots."""

    signature: str
    offset: int
    minimum_reusable_offset: int = 0
    trimmable: bool = True
    ring_index: int | None = None
    max_size: int | None = None
    keep: int | None = None
    bits: int | None = None
    group_size: int | None = None
    slots: tuple[TensorSlot, ...] = ()


@dataclass(frozen=True, slots=True)
class Attachment:
    """Named companion tensors stored beside the caches (their meaning is in `schema`)."""

    name: str
    schema: str
    slots: tuple[TensorSlot, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability and the top alternatives its request asked for."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


@dataclass(frozen=True, slots=True)
class GenerationCheckpoint:
    """An in-flight generation: resume by feeding `pending_token` after `generated_tokens`.

    `logprobs` (when the request asked for them) has one entry per generated token and a last
    one for the pending token, so a resumed request answers the logprobs the first run sent.
    """

    cache_ns: str
    generated_tokens: tuple[int, ...]
    key: str
    original_prompt_tokens: int
    pending_token: int
    seed: int
    seed_was_explicit: bool
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True, slots=True)
class KvFileHeader:
    caches: tuple[CacheHeaderEntry, ...]
    tokens: tuple[int, ...]
    model_id: str
    ns: str
    tokenizer_hash: str
    config_fingerprint: str
    codec_provider: str
    created_at: float
    attachments: tuple[Attachment, ...] = ()
    generation_checkpoint: GenerationCheckpoint | None = None
    format_version: int = FORMAT_VERSION

    @property
    def minimum_reusable_offset(self) -> int:
        """The shortest prefix any reuse may trim the whole entry to."""
        return max((c.minimum_reusable_offset for c in self.caches), default=0)

    @property
    def trimmable(self) -> bool:
        return all(c.trimmable for c in self.caches)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def header_from_json(data: Any) -> KvFileHeader:
    """Parse and validate a header read from disk; raises `HeaderFormatError`."""
    obj = _dict(data, "header")
    version = _get(obj, "format_version", int)
    if version != FORMAT_VERSION:
        raise HeaderFormatError(f"header format version {version} is not supported (this build reads {FORMAT_VERSION})")
    checkpoint = obj.get("generation_checkpoint")
    return KvFileHeader(
        caches=tuple(_cache_entry(c) for c in _get(obj, "caches", list)),
        tokens=_ints(_get(obj, "tokens", list), "tokens"),
        model_id=_get(obj, "model_id", str),
        ns=_get(obj, "ns", str),
        tokenizer_hash=_get(obj, "tokenizer_hash", str),
        config_fingerprint=_get(obj, "config_fingerprint", str),
        codec_provider=_get(obj, "codec_provider", str),
        created_at=float(_get(obj, "created_at", (int, float))),
        attachments=tuple(_attachment(a) for a in _get(obj, "attachments", list)),
        generation_checkpoint=None if checkpoint is None else _checkpoint(checkpoint),
        format_version=version,
    )


def _cache_entry(data: Any) -> CacheHeaderEntry:
    obj = _dict(data, "cache entry")
    return CacheHeaderEntry(
        signature=_get(obj, "signature", str),
        offset=_get(obj, "offset", int),
        minimum_reusable_offset=_get(obj, "minimum_reusable_offset", int),
        trimmable=_get(obj, "trimmable", bool),
        ring_index=_opt_int(obj, "ring_index"),
        max_size=_opt_int(obj, "max_size"),
        keep=_opt_int(obj, "keep"),
        bits=_opt_int(obj, "bits"),
        group_size=_opt_int(obj, "group_size"),
        slots=tuple(_slot(s) for s in _get(obj, "slots", list)),
    )


def _slot(data: Any) -> TensorSlot:
    obj = _dict(data, "tensor slot")
    slot = TensorSlot(
        name=_get(obj, "name", str),
        dtype=_get(obj, "dtype", str),
        shape=_ints(_get(obj, "shape", list), "shape"),
        codec=_get(obj, "codec", str),
        level=_get(obj, "level", int),
        offset=_get(obj, "offset", int),
        stored_bytes=_get(obj, "stored_bytes", int),
        raw_bytes=_get(obj, "raw_bytes", int),
        checksum=_get(obj, "checksum", int),
    )
    if slot.codec not in SLOT_CODECS:
        raise HeaderFormatError(f"slot {slot.name!r} has unknown codec {slot.codec!r}; known: {', '.join(SLOT_CODECS)}")
    if min(slot.offset, slot.stored_bytes, slot.raw_bytes, *slot.shape, 0) < 0:
        raise HeaderFormatError(f"slot {slot.name!r} has a negative size, offset or dimension")
    return slot


def _attachment(data: Any) -> Attachment:
    obj = _dict(data, "attachment")
    return Attachment(
        name=_get(obj, "name", str), schema=_get(obj, "schema", str), slots=tuple(_slot(s) for s in _get(obj, "slots", list))
    )


def _checkpoint(data: Any) -> GenerationCheckpoint:
    obj = _dict(data, "generation checkpoint")
    logprobs = obj.get("logprobs")  # absent in checkpoints written before logprobs were kept
    checkpoint = GenerationCheckpoint(
        cache_ns=_get(obj, "cache_ns", str),
        generated_tokens=_ints(_get(obj, "generated_tokens", list), "generated_tokens"),
        key=_get(obj, "key", str),
        original_prompt_tokens=_get(obj, "original_prompt_tokens", int),
        pending_token=_get(obj, "pending_token", int),
        seed=_get(obj, "seed", int),
        seed_was_explicit=_get(obj, "seed_was_explicit", bool),
        logprobs=None if logprobs is None else tuple(_token_logprobs(e) for e in _list(logprobs, "logprobs")),
    )
    if checkpoint.logprobs is not None and len(checkpoint.logprobs) != len(checkpoint.generated_tokens) + 1:
        raise HeaderFormatError(
            f"checkpoint has {len(checkpoint.logprobs)} logprobs entries for "
            f"{len(checkpoint.generated_tokens)} generated tokens and a pending one"
        )
    return checkpoint


def _token_logprobs(data: Any) -> TokenLogprobs:
    obj = _dict(data, "token logprobs")
    top = []
    for pair in _get(obj, "top", list):
        if not isinstance(pair, list) or len(pair) != 2:
            raise HeaderFormatError("header field 'top' must hold [token id, logprob] pairs")
        top.append((_ints(pair[:1], "top")[0], _number(pair[1], "top")))
    return TokenLogprobs(logprob=_number(_get(obj, "logprob", (int, float)), "logprob"), top=tuple(top))


def _list(data: Any, what: str) -> list[Any]:
    if not isinstance(data, list):
        raise HeaderFormatError(f"header field {what!r} must be a list, got {type(data).__name__}")
    return data


def _number(value: Any, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise HeaderFormatError(f"header field {what!r} must hold numbers, got {type(value).__name__}")
    return float(value)


def _dict(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise HeaderFormatError(f"{what} must be a JSON object, got {type(data).__name__}")
    return data


def _get(obj: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in obj:
        raise HeaderFormatError(f"header field {key!r} is missing")
    value = obj[key]
    # bool is an int in Python: never accept one for the other.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise HeaderFormatError(f"header field {key!r} has type {type(value).__name__}")
    return value


def _opt_int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise HeaderFormatError(f"header field {key!r} must be an integer or null")
    return value


def _ints(values: list[Any], what: str) -> tuple[int, ...]:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise HeaderFormatError(f"header field {what!r} must hold integers only")
    return tuple(values)


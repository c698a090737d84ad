"""S3 backend (boto3): `s3://bucket/prefix`, any S3-compatible store.

Endpoint, region and credentials come the way boto3 reads them (`AWS_ENDPOINT_URL`, `AWS_REGION`,
`AWS_ACCESS_KEY_ID`, profiles, instance roles); `?endpoint=URL&region=R` in the URL overrides the
first two. Retries are off and timeouts short on reads. S3 has no per-key TTL: a manifest older
than the TTL is a miss for every reader (`RemoteStore`), and a lifecycle rule on the bucket frees
the space (docs/replicas.md); a replica keeps no key alive by reading it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from mlxkv_remote_cache.errors import RemoteObjectError, RemoteUnavailableError
from mlxkv_remote_cache.redis_backend import DEFAULT_TIMEOUT_S, DEFAULT_WRITE_TIMEOUT_S

T = TypeVar("T")
_ABSENT = {"NoSuchKey", "404", "NotFound"}
_TAKEN = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


class S3Backend:
    expires_keys = False

    def __init__(self, url: str, timeout_s: float = DEFAULT_TIMEOUT_S, write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"{url!r} is not an s3://bucket[/prefix] URL")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"endpoint", "region"}
        if unknown:
            raise ValueError(f"{url!r}: unknown option(s) {sorted(unknown)}; known: endpoint, region")
        self.url = f"s3://{parts.netloc}{parts.path}"
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/") + "/" if parts.path.strip("/") else ""
        self._reader = _client(query, timeout_s)
        self._writer = _client(query, write_timeout_s)

    def get(self, key: str, max_bytes: int, ttl_s: int) -> bytes | None:
        def read() -> bytes | None:
            try:
                response = self._reader.get_object(Bucket=self.bucket, Key=self.prefix + key)
            except ClientError as e:
                if _code(e) in _ABSENT:
                    return None
                raise
            body, size = response["Body"], int(response["ContentLength"])
            if size > max_bytes:  # the headers came first: the body is never read
                body.close()
                raise RemoteObjectError(f"{key} holds {size} bytes, more than the {max_bytes}-byte limit")
            data: bytes = body.read(max_bytes + 1)
            if len(data) != size:
                raise RemoteObjectError(f"{key}: read {len(data)} of {size} bytes")
            return data
        return self._call(read)

    def put_if_absent(self, key: str, data: bytes, ttl_s: int) -> bool:
        def put() -> bool:
            try:
                self._writer.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data, IfNoneMatch="*")
            except ClientError as e:
                if _code(e) in _TAKEN:
                    return False
                raise
            return True
        return self._call(put)

    def put(self, key: str, data: bytes, ttl_s: int) -> None:
        self._call(lambda: self._writer.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data))

    def delete(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self.prefix + k} for k in keys[start : start + 1000]]
            self._call(lambda: self._writer.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))

    def touch(self, keys: Sequence[str], ttl_s: int) -> None:
        """Nothing: S3 objects expire by the bucket's lifecycle rule, not by key."""

    def list(self, prefix: str) -> list[str]:
        def listed() -> list[str]:
            pages = self._reader.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
            return [o["Key"][len(self.prefix):] for page in pages for o in page.get("Contents", [])]
        return self._call(listed)

    def close(self) -> None:
        self._reader.close()
        self._writer.close()

    def _call(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except (BotoCoreError, ClientError, OSError) as e:
            raise RemoteUnavailableError(f"{self.url}: {type(e).__name__}: {e}") from e


def _client(query: dict[str, str], timeout_s: float) -> Any:
    config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"total_max_attempts": 1},
                    s3={"addressing_style": "path"})
    return boto3.session.Session().client("s3", endpoint_url=query.get("endpoint"), region_name=query.get("region"),
                                          config=config)


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))

"""Faults outside our control: the remote store is down, or an object it returned is not one we trust.
Callers turn every one of them into a cache miss (counted), never into a request error."""


class RemoteCacheError(Exception):
    """Base for every remote tier fault."""


class RemoteUnavailableError(RemoteCacheError):
    """The backend did not answer (connection refused, timeout, server error) or the breaker is open."""


class RemoteObjectError(RemoteCacheError):
    """An object read back is too large, cut short, fails its checksum or its signature."""

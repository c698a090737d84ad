"""The server's adapters by name (`--adapter NAME=PATH`, `POST /v1/adapters`), and which adapters
a request runs under (its `model`, `NAME`, `<model id>:NAME` or `NAME+NAME2`, or mlx_lm.server's
`adapters` field).

An adapter is loaded and checked against the model once; its cache namespace is its digest, so
removing it and adding the same files again (under any name) hits the KV it left on the SSD.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxkv_inference.adapters import Adapter, AdapterBank, AdapterStack, load_adapter
from mlxkv_inference.errors import AdapterLoadError
from mlxkv_serve import UnknownModelError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True, slots=True)
class NamedAdapter:
    name: str
    adapter: Adapter


def parse_adapter_option(value: str) -> tuple[str, Path]:
    """`NAME=PATH` of `--adapter`; ValueError naming the bad value."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise ValueError(f"--adapter takes NAME=PATH, not {value!r}")
    return check_name(name), Path(path).expanduser()


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return name


def allowed_path(path: str, allowed_dirs: tuple[Path, ...]) -> Path:
    """`path` with symlinks and `..` resolved; PermissionError where it is under none of `allowed_dirs`."""
    resolved = Path(path).expanduser().resolve()
    if not any(resolved.is_relative_to(d) for d in allowed_dirs):
        where = ", ".join(str(d) for d in allowed_dirs)
        raise PermissionError(f"adapters load only from under {where}; {path!r} is not" if where else
                              "this server loads no adapters over HTTP (start it with --adapter-dir DIR)")
    return resolved


class AdapterRegistry:
    """Named adapters checked against one model (`bank`, whose id is `model_id`)."""

    def __init__(self, bank: AdapterBank, model_id: str) -> None:
        self._bank = bank
        self.model_id = model_id
        self._named: dict[str, Adapter] = {}
        self._lock = threading.Lock()
        self.allowed_dirs: tuple[Path, ...] = ()  # where `POST /v1/adapters` may load from (`--adapter-dir`)

    def add_allowed(self, name: str, path: str) -> NamedAdapter:
        """`add` for a client (`POST /v1/adapters`): only under `allowed_dirs`.

        Raises:
            PermissionError: no directory is allowed, or `path` (symlinks resolved) is under none.
            ValueError: a bad name, a taken one, unreadable files, an adapter of another model.
        """
        resolved = allowed_path(path, self.allowed_dirs)
        try:
            return self.add(name, resolved)
        except AdapterLoadError as e:
            raise ValueError(str(e)) from e

    def add(self, name: str, path: Path) -> NamedAdapter:
        """Load the adapter directory `path` under `name` (replacing nothing: a taken name is a
        ValueError). Raises `AdapterLoadError` for unreadable files, `AdapterMismatchError` for
        an adapter of another model."""
        check_name(name)
        adapter = load_adapter(path)
        self._bank.check(adapter)
        with self._lock:
            if name in self._named:
                raise ValueError(f"an adapter named {name!r} is already loaded (from {self._named[name].path})")
            self._named[name] = adapter
        return NamedAdapter(name, adapter)

    def remove(self, name: str) -> bool:
        """Forget `name` (its KV stays on the SSD); False when no adapter has that name."""
        with self._lock:
            return self._named.pop(name, None) is not None

    def listed(self) -> list[NamedAdapter]:
        with self._lock:
            return [NamedAdapter(name, adapter) for name, adapter in sorted(self._named.items())]

    def select(self, model: str | None, adapters: Sequence[str] = ()) -> AdapterStack:
        """The adapters a request names: `adapters` (names, or the paths they were loaded from;
        each must be loaded) or else `model` when it names adapters; other models run the base.

        Raises:
            UnknownModelError: a name (or `<model id>:NAME`) that is not loaded.
            ValueError: a stack mlx-lm's math does not allow (a DoRA adapter with another).
        """
        if adapters:
            return AdapterStack(tuple(self._one(name, "adapters") for name in adapters))
        if not model:
            return AdapterStack()
        base, colon, names = model.rpartition(":")
        if colon and base == self.model_id:
            return AdapterStack(tuple(self._one(name, "model") for name in names.split("+")))
        with self._lock:
            known = all(name in self._named for name in model.split("+"))
        return AdapterStack(tuple(self._one(name, "model") for name in model.split("+"))) if known else AdapterStack()

    def _one(self, name: str, field: str) -> Adapter:
        with self._lock:
            found = self._named.get(name) or next(
                (a for a in self._named.values() if str(a.path) == str(Path(name).expanduser().resolve())), None)
            loaded = ", ".join(sorted(self._named)) or "none"
        if found is None:
            raise UnknownModelError(f"no adapter named {name!r} is loaded (in '{field}'); loaded: {loaded}", field)
        return found

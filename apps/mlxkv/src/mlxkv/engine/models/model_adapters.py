"""Adapters clients add to one of several models (`POST /v1/adapters` with its `model`) and remove
(`DELETE /v1/adapters/MODEL:NAME`). An adapter is bound to its model's spec, so the model reads and
checks it again each time it loads, as it does an `--adapter MODEL:NAME=PATH` one.

NOTE: a model that is not loaded is loaded to add an adapter: its weights are what the adapter is
checked against, so an adapter of another base is a 400 to the client that added it, not a failed
load for whoever asks for the model next. The adapter's files are read first, so a bad path or a
corrupt file never loads a model. Removing an adapter never loads one.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path

from mlxkv_inference.adapters import load_adapter
from mlxkv_inference.errors import AdapterLoadError
from mlxkv_serve.engine import AdapterManaging

from mlxkv.engine.adapters import allowed_path, check_name
from mlxkv.engine.models.loading import ModelLoads
from mlxkv.engine.models.residents import ModelEntry, Residents
from mlxkv.engine.models.specs import BoundAdapter


class ModelAdapters:
    def __init__(self, residents: Residents, loads: ModelLoads, adapter_dirs: tuple[Path, ...]) -> None:
        self._residents, self._loads, self._adapter_dirs = residents, loads, adapter_dirs
        self._changing: dict[str, asyncio.Lock] = {}  # one change at a time per model: its spec and engine agree

    async def add(self, entry: ModelEntry, name: str, path: str) -> dict[str, object]:
        """Bind the adapter at `path` (under an `--adapter-dir`) to `entry`'s model as `name`.

        Raises:
            PermissionError: `path` is under no allowed directory.
            ValueError: a bad or taken name, unreadable files, an adapter of another base.
            ModelUnavailableError: the model could not be loaded to check the adapter against.
        """
        check_name(name)
        resolved = allowed_path(path, self._adapter_dirs)
        self._check_free(entry, name)
        try:
            await asyncio.to_thread(load_adapter, resolved)  # its files, before any model is loaded for it
        except AdapterLoadError as e:
            raise ValueError(str(e)) from e
        async with self._lock(entry):
            with self._residents.entering(entry):  # neither unloaded nor reloaded until it is bound
                engine = (await self._loads.ready(entry)).engine
                if not isinstance(engine, AdapterManaging):
                    raise ValueError(f"the model {entry.name!r} takes no adapters")
                try:
                    added = await engine.add_adapter(name, str(resolved))
                except ValueError as e:
                    raise ValueError(f"model {entry.name!r}: {e}") from e
                with self._residents.lock:
                    entry.spec = replace(entry.spec, adapters=(*entry.spec.adapters, BoundAdapter(name, resolved)))
        return {**added, "id": f"{entry.name}:{name}", "model": entry.name}

    async def remove(self, entry: ModelEntry, name: str) -> str | None:
        """Unbind `name` from `entry`'s model (and its engine, when loaded): the id it was listed
        under, None when the model has no such adapter."""
        async with self._lock(entry):
            with self._residents.entering(entry):  # not unloaded meanwhile
                while True:
                    with self._residents.lock:
                        pending, loaded = entry.loading, entry.loaded
                        if pending is None:  # a load from now on reads the spec without it
                            bound = self._unbind(entry, name)
                            break
                    with contextlib.suppress(Exception):  # a failed load is the load's requests' news
                        await asyncio.wrap_future(pending)
                engine = loaded.engine if loaded is not None else None
                held = isinstance(engine, AdapterManaging) and await engine.remove_adapter(name) is not None
        return f"{entry.name}:{name}" if bound or held else None

    def _lock(self, entry: ModelEntry) -> asyncio.Lock:
        return self._changing.setdefault(entry.name, asyncio.Lock())

    def _check_free(self, entry: ModelEntry, name: str) -> None:
        with self._residents.lock:
            taken = next((a for a in entry.spec.adapters if a.name == name), None)
        if taken is not None:
            raise ValueError(f"the model {entry.name!r} already has an adapter named {name!r} (from {taken.path})")

    def _unbind(self, entry: ModelEntry, name: str) -> bool:
        """Under the residents' lock: drop `name` from the spec; whether it was there."""
        kept = tuple(a for a in entry.spec.adapters if a.name != name)
        found = len(kept) < len(entry.spec.adapters)
        entry.spec = replace(entry.spec, adapters=kept)
        return found

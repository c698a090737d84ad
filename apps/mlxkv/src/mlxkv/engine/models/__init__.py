"""Several models behind one `ServeEngine`, each request served by its `model`.

Each loaded model is its own engine (a `LocalEngine`, with its own worker thread: MLX on the CPU
runs several threads' graphs at once, each token what it would be alone). Models load on demand on
one loader thread; requests for a model being loaded wait for it. At most `max_models` are loaded;
the least recently used idle one that is not pinned makes room, as does one idle for `ttl_s`.
Unloading closes the engine (its write-behind flushed, its RAM tier released); its SSD KV stays.

    specs.py      ModelSpec, LoadedModel, ModelPolicy: what the router is given
    residents.py  each registered model's state (loaded, loading, in use) under one lock
    eviction.py   room for a load or a request: LRU unloading, the memory budget, the TTL reaper
    loading.py    the loader thread
    model_adapters.py  adapters clients add to and remove from a model (bound to its spec)
    router.py     ModelRouter: the ServeEngine and ModelCatalog that wires them
"""

from mlxkv.engine.models.router import ModelRouter
from mlxkv.engine.models.specs import DEFAULT_WAIT_S, BoundAdapter, LoadedModel, Loader, ModelPolicy, ModelSpec

__all__ = ["DEFAULT_WAIT_S", "BoundAdapter", "LoadedModel", "Loader", "ModelPolicy", "ModelRouter", "ModelSpec"]

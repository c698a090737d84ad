"""Run in a fresh process by the persistence tests: restore a stored prefix and continue greedily.

    python -m tests.fork_restore SPEC_JSON   ->   prints the continuation's token ids as JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from mlxkv_inference import Generation, GenerationParams, KvScheme, MlxAutoregressiveBinding, load_binding
from mlxkv_ssd_cache import SsdCacheStore
from tests.factories import make_identity, make_tiny_binding


def binding_for(spec: dict[str, Any]) -> MlxAutoregressiveBinding:
    scheme = KvScheme(**spec.get("kv_scheme", {}))
    if spec["kind"] == "embedded":
        return load_binding(None, scheme, spec.get("cpu_kernels", "mlx"))
    return make_tiny_binding(spec["kind"], kv_scheme=scheme, **spec.get("overrides", {}))


def continue_from_store(spec: dict[str, Any]) -> dict[str, Any]:
    binding = binding_for(spec)
    store = SsdCacheStore(Path(spec["directory"]), make_identity(binding), 1 << 30)
    prompt: list[int] = spec["prompt"]
    hit = store.find(prompt)
    if hit is None:
        return {"cached": 0, "tokens": []}
    restored = store.restore(hit)
    if restored is None:
        return {"cached": -1, "tokens": []}
    params = GenerationParams(max_tokens=spec["max_tokens"], ignore_eos=True)
    result = Generation(binding, prompt, params, caches=restored.caches).run()
    return {"cached": result.cached_tokens, "tokens": list(result.token_ids)}


if __name__ == "__main__":
    print(json.dumps(continue_from_store(json.loads(sys.argv[1]))))

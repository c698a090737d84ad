"""Model load time, phase by phase: today's loader against the reference paths, in one run.

`load_binding` runs as it always does; each phase's function is wrapped in a timer. Reference
rounds swap in the loader as it was: `read_gguf` with MLX's loader first and the `gguf` package's
reader (GGUFReader, a numpy view per metadata value) for what MLX refuses, instead of
`gguf_file`; and the one-dict-lookup-per-split loop for the SPM merges. Rounds alternate (reference, fast, ...) and medians are compared. Both paths build
the same binding: the config fingerprint and the tokenizer hash are checked equal every round.

    read       the GGUF file's metadata and tensor blocks (read_gguf less the conversion)
    convert    GGUF blocks -> MLX arrays (affine triples, float32)
    build      mlx-lm model: names, quantized layers, load_weights (load_gguf less read_gguf)
    tokenizer  vocabulary -> `tokenizers` BPE and its content hash; merges: the SPM merges in it
    digest     xxh3 of the weights (no memo: every round reads the file)
    binding    the binding: native kernels installed, start-up probes

The first load of a process also imports mlx-lm (and transformers); it is timed once, apart.
Run: `uv run --group gemma3 python -m tools.bench_load [--model gemma3-270m|embedded|PATH] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

from mlxkv_inference import MlxAutoregressiveBinding, load_binding  # first: the BLAS shim precedes mlx

import mlx.core as mx  # noqa: E402, I001
from mlxkv.paths import default_cache_dir
from mlxkv_inference import _mlx_lm, load as load_module
from mlxkv_inference.models import gguf, gguf_reader
from mlxkv_inference.models.embedded import embedded_model_path
from mlxkv_inference.models.gemma3_270m import gemma3_270m_path
from mlxkv_inference.tokenizer import gguf_spm
from mlxkv_inference.tokenizer.gguf_spm_merges import spm_merges_by_lookup
from tools.bench_generate import cpu_model

PHASES = ("read", "convert", "build", "tokenizer", "merges", "digest", "binding", "total")
Times = dict[str, float]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m", help="gemma3-270m, embedded, or a .gguf path")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (reference, fast)")
    parser.add_argument("--cpu-kernels", default="native", choices=["native", "mlx"])
    args = parser.parse_args()
    path = model_path(args.model)
    print(f"cpu {cpu_model()}, {os.cpu_count()} cores; load average {load_average()}")
    print(f"model {path} ({path.stat().st_size / 1e6:.0f} MB), cpu kernels {args.cpu_kernels}")
    start = time.perf_counter()
    _mlx_lm.model_classes({"model_type": "llama"})
    print(f"import mlx-lm (once a process): {time.perf_counter() - start:.2f} s")
    runs: dict[str, list[Times]] = {"reference": [], "fast": []}
    identity: set[tuple[str, str]] = set()
    for _ in range(args.rounds):
        for mode in runs:
            times, binding = timed_load(path, args.cpu_kernels, reference=mode == "reference")
            runs[mode].append(times)
            identity.add((binding.config_fingerprint, binding.tokenizer_hash))
            del binding  # freed before the next load, not during it
    assert len(identity) == 1, f"the two paths built different bindings: {identity}"
    report(runs)
    print(f"same config fingerprint and tokenizer hash on both paths; load average after: {load_average()}")


def model_path(model: str) -> Path:
    if model == "gemma3-270m":
        return gemma3_270m_path(default_cache_dir())
    if model == "embedded":
        return embedded_model_path()
    return Path(model)


def timed_load(path: Path, cpu_kernels: Any, *, reference: bool) -> tuple[Times, MlxAutoregressiveBinding]:
    spent: defaultdict[str, float] = defaultdict(float)
    with ExitStack() as stack:
        if reference:
            stack.enter_context(mock.patch.object(gguf, "read_gguf", reference_read_gguf))
            stack.enter_context(mock.patch.object(gguf_spm, "spm_merges", spm_merges_by_lookup))
        for target, name, phase in (
            (gguf, "read_gguf", "read_gguf"), (gguf_reader, "_convert", "convert"), (load_module, "load_gguf", "load_gguf"),
            (load_module, "GgufTokenizer", "tokenizer"), (gguf_spm, "spm_merges", "merges"),
            (load_module, "weights_digest", "digest"), (load_module, "MlxAutoregressiveBinding", "binding"),
        ):
            stack.enter_context(mock.patch.object(target, name, timer(getattr(target, name), phase, spent)))
        start = time.perf_counter()
        binding = load_binding(path, cpu_kernels=cpu_kernels)
        spent["total"] = time.perf_counter() - start
    times = {
        "read": spent["read_gguf"] - spent["convert"], "convert": spent["convert"],
        "build": spent["load_gguf"] - spent["read_gguf"], **{p: spent[p] for p in ("tokenizer", "merges", "digest", "binding", "total")},
    }
    return times, binding


def reference_read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """`read_gguf` before `gguf_file`: MLX's loader first, gguf's reader for any file MLX refuses
    or reads inexactly."""
    try:
        weights, metadata = _mlx_lm.load_gguf_file(str(path))
    except (RuntimeError, ValueError, OSError):
        return gguf_reader._read_with_gguf(path)
    if all(name.endswith((".scales", ".biases")) or t.dtype in (mx.uint32, mx.float32) for name, t in weights.items()):
        return weights, metadata
    return gguf_reader._read_with_gguf(path)


def timer(function: Callable[..., Any], phase: str, spent: defaultdict[str, float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - start

    return timed


def report(runs: dict[str, list[Times]]) -> None:
    print(f"\nphase        reference s   fast s    ratio   (medians of {len(runs['fast'])} rounds)")
    for phase in PHASES:
        ref = statistics.median(t[phase] for t in runs["reference"])
        fast = statistics.median(t[phase] for t in runs["fast"])
        ratio = f"{ref / fast:6.1f}x" if fast > 0.0005 else "     -"
        print(f"{phase:<12} {ref:>10.3f} {fast:>9.3f}  {ratio}")


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


if __name__ == "__main__":
    main()

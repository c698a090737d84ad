"""Restore vs re-prefill on the embedded model, and slot codec throughput, in one run.

For each prompt length: prefill it (the re-prefill time), persist the KV with each slot codec,
and restore it into fresh caches (median of 3). Beside each restore: a raw sequential read of a
file of the same size, measured in the same run. Run: `uv run python tools/bench_restore.py`.
NOTE: files are read back from the page cache (the same for the raw read), as on a warm machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlxkv_inference import load_binding
from mlxkv_ssd_cache import KvIdentity, SlotPolicy, read_file, write_file_atomically
from mlxkv_ssd_cache.kv_file import build_header

TEXT = (
    "In the archive of the harbour town the clerks kept ledgers of every ship that came and went: "
    "its cargo, its captain, the weather of the crossing and the price of salt on the day it docked. "
)
POLICIES = {"raw": SlotPolicy(level=0), "zstd-1": SlotPolicy(level=1, codec="zstd"),
            "shuffle+zstd-1": SlotPolicy(level=1, codec="shuffle+zstd"), "default": SlotPolicy()}


def median_s(fn: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def raw_read_s(size: int, directory: Path) -> float:
    path = directory / "raw.bin"
    path.write_bytes(os.urandom(size))
    path.read_bytes()  # into the page cache, like the KV file just written

    def read() -> bytes:
        with path.open("rb", buffering=0) as f:
            return f.read()

    return median_s(read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1024,4096,8192", help="prompt lengths in tokens")
    args = parser.parse_args()
    binding = load_binding()
    identity = KvIdentity(binding.model_id, binding.tokenizer_hash, binding.config_fingerprint)
    text_ids = binding.tokenizer.encode(TEXT * 400)
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-") as scratch:  # the files go with it
        work = Path(scratch)
        print(f"model {binding.model_id}; KV dtype float32; MB = 1e6 bytes")
        for n in (int(s) for s in args.sizes.split(",")):
            prompt = text_ids[:n]
            assert len(prompt) == n, f"need a longer text for {n} tokens"
            caches = binding.make_cache()
            start = time.perf_counter()
            binding.prefill(prompt, caches)
            prefill_s = time.perf_counter() - start
            kv_bytes = sum(c.nbytes for c in caches) * n // max(1, caches[0].keys.shape[2])  # type: ignore[union-attr]
            print(f"\n{n} tokens: re-prefill {prefill_s:.2f} s ({n / prefill_s:.1f} tok/s); KV {kv_bytes / 1e6:.1f} MB")
            print(f"  {'codec':15} {'file MB':>8} {'write MB/s':>10} {'restore ms':>10} {'restore MB/s':>12} {'raw read MB/s':>13} {'restore/raw':>11} {'prefill/restore':>15}")
            for name, policy in POLICIES.items():
                path = work / f"{n}-{name}.mlxkv"
                header = build_header(identity, prompt, "", None)
                write_s = median_s(lambda: write_file_atomically(path, header, caches, policy=policy), repeats=1)
                size = path.stat().st_size
                restore_s = median_s(lambda: mx.eval([c.state for c in read_file(path)[1]]))
                raw_s = raw_read_s(size, work)
                print(f"  {name:15} {size / 1e6:8.1f} {size / 1e6 / write_s:10.0f} {restore_s * 1000:10.1f} "
                      f"{size / 1e6 / restore_s:12.0f} {size / 1e6 / raw_s:13.0f} {raw_s / restore_s:11.2f} {prefill_s / restore_s:15.0f}x")
                path.unlink()


if __name__ == "__main__":
    main()

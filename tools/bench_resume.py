"""Generation checkpoints: decode tokens/s with checkpoints on vs off (same run, alternating), and
the time from a restart to the first resumed token vs regenerating up to that point from scratch.
Run: `uv run python -m tools.bench_resume`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from mlxkv.engine.cache_services import SsdColdTier
from mlxkv.engine.checkpoints import CheckpointWriter
from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, SamplingParams, load_binding
from mlxkv_inference.generation.results import CheckpointState, ResumePoint
from mlxkv_ssd_cache import KvIdentity, SsdCacheStore
from mlxkv_state.header import GenerationCheckpoint
from tools.bench_generate import time_stream

PROMPT = "Once upon a time, in a kingdom by the sea, there lived"
KEY = "be" * 32


def identity(binding: MlxAutoregressiveBinding) -> KvIdentity:
    return KvIdentity(binding.model_id, binding.tokenizer_hash, binding.config_fingerprint)


def decode_tps(binding: MlxAutoregressiveBinding, prompt: list[int], params: GenerationParams, writer: CheckpointWriter | None, every: int) -> float:
    def save(state: CheckpointState) -> None:
        assert writer is not None
        checkpoint = GenerationCheckpoint("", state.generated, KEY, len(prompt), state.pending, state.seed, True)
        writer.save(prompt + list(state.generated), state.caches, checkpoint)

    generation = Generation(binding, prompt, params, checkpoint_every=every if writer else 0, on_checkpoint=save if writer else None)
    tps = time_stream(len(prompt), generation).decode_tps
    if writer is not None:
        writer.flush(60)
    return tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--every", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    binding = load_binding()
    prompt = binding.tokenizer.encode(PROMPT)
    params = GenerationParams(max_tokens=args.tokens, sampling=SamplingParams(temperature=0.8, seed=7), ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-resume-") as work:  # the store goes with it
        directory = Path(work)
        store = SsdCacheStore(directory, identity(binding), 1 << 30)
        writer = CheckpointWriter(SsdColdTier(store))
        decode_tps(binding, prompt[:4], GenerationParams(max_tokens=4), None, 0)  # warm-up
        on, off = [], []
        for _ in range(args.repeats):
            off.append(decode_tps(binding, prompt, params, None, 0))
            on.append(decode_tps(binding, prompt, params, writer, args.every))
        writer.close(60)
        print(f"model {binding.model_id}: {len(prompt)}-token prompt, {args.tokens} tokens, checkpoint every {args.every}; {args.repeats} runs each")
        print(f"  decode off {statistics.median(off):.2f} tok/s  on {statistics.median(on):.2f} tok/s  "
              f"ratio on/off {statistics.median(on) / statistics.median(off):.3f}x")

        # A restart: a fresh store over the directory, the newest checkpoint, the first resumed token.
        start = time.perf_counter()
        restored = SsdCacheStore(directory, identity(binding), 1 << 30).load_checkpoint(KEY)
        assert restored is not None and restored.generation_checkpoint is not None
        checkpoint = restored.generation_checkpoint
        resumed = Generation(binding, prompt, params, caches=restored.caches,
                             resume=ResumePoint(checkpoint.generated_tokens, checkpoint.pending_token))
        stream = iter(resumed)
        for delta in stream:  # replayed text comes first, then the pending token
            if delta.step is not None:
                break
        resume_s = time.perf_counter() - start
        k = len(checkpoint.generated_tokens)
        start = time.perf_counter()
        scratch = Generation(binding, prompt, GenerationParams(max_tokens=k + 1, sampling=params.sampling, ignore_eos=True))
        scratch.run()
        scratch_s = time.perf_counter() - start
        print(f"  restart -> first resumed token (token {k + 1}): {resume_s * 1000:.0f} ms; "
              f"regenerating {k + 1} tokens from scratch: {scratch_s:.2f} s ({scratch_s / resume_s:.0f}x)")


if __name__ == "__main__":
    main()

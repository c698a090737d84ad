"""Decode tok/s of 8 streams over 3 LoRA adapters and the base model, against 8 streams on the
base alone, in one run (same prompts, same lengths, the scheduler batching them; EOS ignored).

The adapters are random, shaped as `mlx_lm.lora` trains by default: rank 8 on the seven linears of
the last 16 layers (the speed does not depend on the values). Runs alternate; medians compared.
Then the wall time of one decode step over the streams (one token each, after a 24-token
prompt), base alone, the mix, and one adapter on every row, alternating `--step-repeats` times:
each one's minimum, and the median over the rounds of base / mix (the streams' rates move with the
machine's load; a ratio of neighbouring steps moves much less).
Run: `uv run python -m tools.bench_adapters [--streams 8 --max-tokens 64 --repeats 3 --step-repeats 24]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, load_binding  # first: the BLAS shim

import mlx.core as mx  # noqa: E402, I001
from mlxkv_inference.adapters import AdapterStack, load_adapter
from mlxkv_inference.cache.factory import LayerCache
from mlxkv_inference.native.kernels import default_cpu_kernels
from mlxkv_inference.scheduler.batch import BatchScheduler
from tools.bench_generate import cpu_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def write_adapter(binding: MlxAutoregressiveBinding, directory: Path, seed: int, rank: int = 8, layers: int = 16) -> Path:
    import json

    model: object = binding.model
    blocks = getattr(getattr(model, "model"), "layers")
    tensors: dict[str, mx.array] = {}
    key = mx.random.key(seed)
    for index in range(len(blocks) - layers, len(blocks)):
        for name in LINEARS:
            module = blocks[index]
            for part in name.split("."):
                module = getattr(module, part)
            bits = getattr(module, "bits", 32)
            inputs, outputs = int(module.weight.shape[1] * 32 // bits), int(module.weight.shape[0])
            key, a, b = mx.random.split(key, 3)
            tensors[f"model.layers.{index}.{name}.lora_a"] = mx.random.normal((inputs, rank), key=a) * inputs ** -0.5
            tensors[f"model.layers.{index}.{name}.lora_b"] = mx.random.normal((rank, outputs), key=b) * 0.01
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": {"rank": rank, "scale": 20.0, "dropout": 0.0}}))
    mx.save_safetensors(str(directory / "adapters.safetensors"), tensors)
    return directory


def run_streams(binding: MlxAutoregressiveBinding, stacks: list[AdapterStack], max_tokens: int) -> float:
    """Decode tok/s of one generation per stack, all added at once and stepped to the end."""
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = [[1 + (7 * i + j) % 1000 for j in range(24)] for i in range(len(stacks))]
    generations = [Generation(binding, prompt, params,
                              caches=binding.adapters.tag(binding.make_cache(), stack) if stack.adapters else None)
                   for prompt, stack in zip(prompts, stacks)]
    scheduler = BatchScheduler(binding, max_batch=len(stacks), prefill_budget=512)
    for generation in generations:
        scheduler.add(generation)
    while any(g.prefilling for g in generations):
        scheduler.step()
    started, decoded = time.perf_counter(), sum(len(g.fed_tokens()) for g in generations)
    while scheduler.running:
        scheduler.step()
    results = [g.result for g in generations]
    assert all(r is not None for r in results)
    return (sum(r.generated_tokens for r in results if r is not None) - (decoded - sum(map(len, prompts)))) / (
        time.perf_counter() - started)


def step_times(binding: MlxAutoregressiveBinding, mixes: dict[str, list[AdapterStack]],
               repeats: int) -> dict[str, list[float]]:
    """Wall seconds of one batched decode step per mix, `repeats` rounds (the mixes alternate)."""
    sequences: dict[str, list[list[LayerCache]]] = {}
    for name, stacks in mixes.items():
        sequences[name] = []
        for i, stack in enumerate(stacks):
            caches = binding.adapters.tag(binding.make_cache(), stack) if stack.adapters else binding.make_cache()
            binding.prefill([1 + (7 * i + j) % 1000 for j in range(24)], caches)
            sequences[name].append(caches)
    times: dict[str, list[float]] = {name: [] for name in mixes}
    for _ in range(repeats):
        for name, batch in sequences.items():
            tokens = mx.array([5] * len(batch))
            started = time.perf_counter()
            mx.eval(binding.decode_batch(tokens, batch))
            times[name].append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-repeats", type=int, default=24)
    args = parser.parse_args()
    binding = load_binding(cpu_kernels=default_cpu_kernels())
    binding.warm_up(compiled=True, rows=args.streams)
    with tempfile.TemporaryDirectory() as root:
        adapters = [load_adapter(write_adapter(binding, Path(root) / f"a{i}", seed=i)) for i in range(3)]
        mixed = [AdapterStack((adapters[i % 4],)) if i % 4 < 3 else AdapterStack() for i in range(args.streams)]
        base = [AdapterStack() for _ in range(args.streams)]
        runs: dict[str, list[float]] = {"base": [], "adapters": []}
        run_streams(binding, mixed, 8)  # warm: traces and buffers
        for _ in range(args.repeats):
            runs["base"].append(run_streams(binding, base, args.max_tokens))
            runs["adapters"].append(run_streams(binding, mixed, args.max_tokens))
        steps = step_times(binding, {"base": base, "mix": mixed, "one adapter on every row":
                                     [AdapterStack((adapters[0],)) for _ in range(args.streams)]}, args.step_repeats)
    base_tps, mixed_tps = statistics.median(runs["base"]), statistics.median(runs["adapters"])
    print(f"cpu: {cpu_model()}; kernels {binding.cpu_kernels}; {args.streams} streams x {args.max_tokens} tokens, "
          f"median of {args.repeats}")
    print(f"  base only:                 {base_tps:7.1f} tok/s  {[round(x, 1) for x in runs['base']]}")
    print(f"  3 adapters (rank 8, 16 layers x 7 linears) + base: {mixed_tps:7.1f} tok/s  "
          f"{[round(x, 1) for x in runs['adapters']]}")
    print(f"  ratio adapters / base: {mixed_tps / base_tps:.2f}x (target >= 0.8x)")
    pairs = statistics.median(b / m for b, m in zip(steps["base"], steps["mix"], strict=True))
    print(f"one {args.streams}-row decode step, minimum of {args.step_repeats}: "
          + ", ".join(f"{name} {1000 * min(seconds):.1f} ms" for name, seconds in steps.items())
          + f"; base / mix, median of the rounds: {pairs:.2f}x")
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()

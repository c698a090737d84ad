"""What a compiled step of L positions (a speculative round) costs, with and without the native
elementwise kernels, in one run.

Loads the model (Gemma 3 270M unless --model) on the native path three times: as installed, with
Gemma's RMSNorm back on MLX's op, and with both its GeGLU and RMSNorm back on MLX's (the mixins
undone), then times `binding.decode_compiled` over L = 1, 3, 5, 9 positions after a prompt, the
settings alternating, each L a median of --repeats steps, and prints ms per step, the ratio to the
MLX setting, and a round's cost in single steps.
Run: `uv run python -m tools.bench_rounds [--prompt-tokens 64] [--repeats 15]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from mlxkv_inference import MlxAutoregressiveBinding, load_binding  # first: the BLAS shim precedes mlx

import mlx.core as mx  # noqa: E402, I001
from mlxkv.paths import default_cache_dir
from mlxkv_inference.cache.rounds import Round
from mlxkv_inference.models.gemma3_270m import gemma3_270m_path
from mlxkv_inference.native.kernels import describe_cpu_kernels
from mlxkv_inference.native.mlp import NativeGegluMixin
from mlxkv_inference.native.norm import NativeGemmaRmsNormMixin
from tools.bench_generate import cpu_model

SETTINGS = {"mlx activations": (NativeGegluMixin, NativeGemmaRmsNormMixin), "native geglu": (NativeGemmaRmsNormMixin,),
            "native geglu + norm": ()}


def undo(binding: MlxAutoregressiveBinding, mixins: tuple[type, ...]) -> int:
    """Gives the modules carrying one of `mixins` their mlx-lm class back; returns how many."""
    changed = 0
    for _, module in binding.model.named_modules():  # type: ignore[no-untyped-call]  # mlx leaves it untyped
        mixin = next((m for m in mixins if isinstance(module, m)), None)
        if mixin is not None:
            module.__class__ = next(base for base in type(module).__bases__ if base is not mixin)
            changed += 1
    return changed


class Steps:
    """Compiled steps of a binding after `prompt`, each over fresh clones of the prompt's caches."""

    def __init__(self, binding: MlxAutoregressiveBinding, prompt: list[int]) -> None:
        self.binding = binding
        self.prompt = prompt
        self.caches = binding.make_cache()
        binding.prefill(prompt, self.caches)
        first = binding.decode_compiled(mx.array(prompt[-1:]), self.caches)
        assert first is not None
        mx.eval(first)

    def ms(self, positions: int) -> tuple[float, float]:
        """(wall-clock, process CPU) ms of one compiled step over `positions` tokens."""
        fresh = [c.clone() for c in self.caches]
        mx.eval([c.state for c in fresh])
        if positions > 1:
            Round(fresh, positions)
        start, cpu = time.perf_counter(), time.process_time()
        logits = self.binding.decode_compiled(mx.array(self.prompt[:positions]), fresh)
        assert logits is not None, "this model cannot run a compiled round"
        mx.eval(logits)
        return 1000 * (time.perf_counter() - start), 1000 * (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m", help="gemma3-270m (default) or a path")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--positions", type=int, nargs="+", default=[1, 3, 5, 9])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    path = gemma3_270m_path(default_cache_dir()) if args.model == "gemma3-270m" else args.model
    print(f"cpu {cpu_model()}, {os.cpu_count()} cores, kernels {describe_cpu_kernels('native')}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    bindings = {}
    for name, mixins in SETTINGS.items():
        bindings[name] = binding = load_binding(path, cpu_kernels="native")
        print(f"  {name}: {undo(binding, mixins)} modules back on mlx-lm's classes")
    words = "The history of the lighthouse "
    prompt = bindings["mlx activations"].tokenizer.encode(words * (1 + args.prompt_tokens // 4))[: args.prompt_tokens]
    steps = {name: Steps(binding, prompt) for name, binding in bindings.items()}
    for step in steps.values():  # trace every shape once
        for n in args.positions:
            step.ms(n)
    times: dict[str, dict[int, list[tuple[float, float]]]] = {name: {n: [] for n in args.positions} for name in steps}
    for _ in range(args.repeats):  # settings alternate, so drifting load hits them alike
        for name, step in steps.items():
            for n in args.positions:
                times[name][n].append(step.ms(n))
    print(f"model {args.model}: compiled step after {len(prompt)} prompt tokens, median of {args.repeats}")
    for clock, index in (("wall-clock ms", 0), ("process CPU ms (both kernel threads)", 1)):
        results = {name: {n: statistics.median(t[index] for t in ts) for n, ts in row.items()} for name, row in times.items()}
        report(clock, results, args.positions)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


def report(clock: str, results: dict[str, dict[int, float]], positions: list[int]) -> None:
    print(f"  {clock:38s}" + "".join(f"{f'L={n}':>9s}" for n in positions) + "  L=max / L=1")
    reference = results["mlx activations"]
    for name, row in results.items():
        cells = "".join(f"{row[n]:9.2f}" for n in positions)
        print(f"  {name:38s}{cells}  {row[max(positions)] / row[min(positions)]:.2f}")
        if name != "mlx activations":
            print(f"  {'  / mlx activations':38s}" + "".join(f"{row[n] / reference[n]:9.3f}" for n in positions))


if __name__ == "__main__":
    main()

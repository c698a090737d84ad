"""How far the native CPU kernels' logits are from MLX's own, on the embedded model (or --model).

1. Teacher forcing: the repository README (~2,000 tokens) goes through both paths in the same
   chunks; per position: KL(mlx || native) of the next-token distributions, |logit difference|
   and whether the top-1 token agrees. Targets (issue 11): top-1 >= 99.9 %, mean KL <= 1e-6.
2. Greedy answers on the parity prompts: any prompt whose text differs, and the first step where.
Run: `uv run python tools/kernel_agreement.py [--tokens 2000] [--max-tokens 64]`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, load_binding  # first: BLAS shim

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxkv_inference._blas import blas_description  # noqa: E402
from mlxkv_inference._mlx_lm import forward  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "README.md"
PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Explain how a bicycle works.",
    "List three uses of copper.",
]


def chunk_stats(ref: mx.array, got: mx.array) -> tuple[np.ndarray, float, np.ndarray]:
    """Per position KL(ref || got), the largest |logit difference|, per position top-1 agreement."""
    ref_lp = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    got_lp = got - mx.logsumexp(got, axis=-1, keepdims=True)
    kl = mx.sum(mx.exp(ref_lp) * (ref_lp - got_lp), axis=-1)
    max_diff = mx.max(mx.abs(ref - got))
    agree = mx.argmax(ref, axis=-1) == mx.argmax(got, axis=-1)
    return np.array(kl), float(np.array(max_diff)), np.array(agree)


def teacher_forced(mlx_path: MlxAutoregressiveBinding, native: MlxAutoregressiveBinding, tokens: list[int], chunk: int) -> None:
    caches = {"mlx": mlx_path.make_cache(), "native": native.make_cache()}
    kls, agrees, max_diff = [], [], 0.0
    for start in range(0, len(tokens), chunk):
        ids = mx.array(tokens[start : start + chunk])[None]
        ref = forward(mlx_path.model, ids, list(caches["mlx"]))[0].astype(mx.float32)
        got = forward(native.model, ids, list(caches["native"]))[0].astype(mx.float32)
        kl, diff, agree = chunk_stats(ref, got)
        kls.append(kl)
        agrees.append(agree)
        max_diff = max(max_diff, diff)
    kl_all, agree_all = np.concatenate(kls), np.concatenate(agrees)
    print(f"teacher-forced {len(tokens)} tokens (chunks of {chunk}), BLAS {blas_description()}:")
    print(f"  mean KL(mlx || native) {kl_all.mean():.3e}   max KL {kl_all.max():.3e}")
    print(f"  max |logit difference| {max_diff:.3e}")
    print(f"  top-1 agreement {100 * agree_all.mean():.3f} % ({int(agree_all.sum())}/{agree_all.size})")


def greedy(binding: MlxAutoregressiveBinding, prompt: list[int], max_tokens: int) -> list[int]:
    return list(Generation(binding, prompt, GenerationParams(max_tokens=max_tokens)).run().token_ids)


def greedy_parity(mlx_path: MlxAutoregressiveBinding, native: MlxAutoregressiveBinding, max_tokens: int) -> None:
    print(f"greedy answers, {max_tokens} tokens at most:")
    for text in PARITY_PROMPTS:
        prompt = mlx_path.tokenizer.encode(text)
        ref, got = greedy(mlx_path, prompt, max_tokens), greedy(native, prompt, max_tokens)
        if ref == got:
            print(f"  same   {text!r} ({len(ref)} tokens)")
            continue
        step = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        print(f"  DIFFER {text!r} from step {step}:\n    mlx:    {mlx_path.tokenizer.decode(ref)!r}\n"
              f"    native: {native.tokenizer.decode(got)!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a llama .gguf file or mlx-lm directory (default: embedded)")
    parser.add_argument("--tokens", type=int, default=2000, help="teacher-forced tokens")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    mlx_path = load_binding(args.model, cpu_kernels="mlx")
    native = load_binding(args.model, cpu_kernels="native")
    text = TEXT.read_text()
    tokens = mlx_path.tokenizer.encode(text)
    while len(tokens) < args.tokens:
        tokens += tokens
    teacher_forced(mlx_path, native, tokens[: args.tokens], args.chunk)
    greedy_parity(mlx_path, native, args.max_tokens)


if __name__ == "__main__":
    main()

"""A simulated agent conversation: 10 turns growing to ~3k tokens, each re-sending its history.

Mean time to first token with mlxkv's tiers vs mlx-lm's own `LRUPromptCache` on the same model
object and the same prompts, in one run; then the first turn after a restart (new tiers over the
same SSD directory, empty RAM) vs a cold prefill of that prompt. Run:
`uv run python tools/bench_multiturn.py` (about 20 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlxkv.engine.cache_services import build_tiers
from mlxkv_inference import GenerationParams, MlxAutoregressiveBinding, load_binding
from mlxkv_inference._mlx_lm import mlx_lm_prompt_cache_turn
from mlxkv_inference.generation.cached_generation import CachedGenerator
from mlxkv_inference.tokenizer.chat import encode_chat
from mlxkv_inference.tokenizer.gguf_tokenizer import GgufTokenizer

TOOL_OUTPUT = (
    "src/server/routes.py:{n}: def handle_{n}(request): validate the payload, look up the session, "
    "call the worker and stream the result back; errors map to 4xx with a message. "
)
REPLY = "I read the output. Next I will open the file that defines the handler and check the error path."


def conversation(turns: int, tool_lines: int) -> list[list[dict[str, str]]]:
    """The message list sent at each turn (replies are a fixed transcript, the same for both)."""
    messages = [{"role": "system", "content": "You are a coding agent. Use the tool outputs to answer."}]
    out = []
    for t in range(turns):
        output = "".join(TOOL_OUTPUT.format(n=t * 100 + i) for i in range(tool_lines))
        messages.append({"role": "user", "content": f"Tool output {t}:\n{output}"})
        out.append(list(messages))
        messages.append({"role": "assistant", "content": REPLY})
    return out


def first_token_s(tokens: Iterable[object]) -> float:
    start = time.perf_counter()
    for _ in tokens:
        return time.perf_counter() - start
    raise RuntimeError("the generation produced no token")


def run_ours(binding: MlxAutoregressiveBinding, prompts: list[list[int]], directory: Path, n: int) -> list[float]:
    tiers, _ = build_tiers(binding, ram_bytes=4 << 30, ssd_dir=directory, ssd_bytes=20 << 30)
    generator = CachedGenerator(binding, tiers)
    ttfts = []
    for prompt in prompts:
        generation = generator.start(prompt, GenerationParams(max_tokens=n, ignore_eos=True))
        stream = iter(generation)
        ttfts.append(first_token_s(stream))
        for _ in stream:
            pass
        generator.settle(generation)
    tiers.close(120)
    return ttfts


def run_mlx_lm(binding: MlxAutoregressiveBinding, prompts: list[list[int]], n: int) -> list[float]:
    tokenizer = binding.tokenizer
    assert isinstance(tokenizer, GgufTokenizer)
    state: dict[str, Any] = {}
    return [mlx_lm_prompt_cache_turn(binding.model, tokenizer.backend, state, prompt, n, first_token_s) for prompt in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--tool-lines", type=int, default=7, help="tool output lines per turn (~40 tokens each)")
    parser.add_argument("--gen-tokens", type=int, default=16)
    args = parser.parse_args()
    binding = load_binding()
    prompts = [encode_chat(binding.tokenizer, m).tokens for m in conversation(args.turns, args.tool_lines)]
    with tempfile.TemporaryDirectory(prefix="mlxkv-multiturn-") as scratch, \
            tempfile.TemporaryDirectory(prefix="mlxkv-cold-") as cold_scratch:  # the stores go with them
        directory = Path(scratch)
        print(f"model {binding.model_id}: {args.turns} turns, prompts {len(prompts[0])} -> {len(prompts[-1])} tokens, {args.gen_tokens} generated a turn")
        ours = run_ours(binding, prompts, directory, args.gen_tokens)
        theirs = run_mlx_lm(binding, prompts, args.gen_tokens)
        print(f"  {'turn':>4} {'prompt':>7} {'mlxkv ttft s':>13} {'mlx-lm ttft s':>14}")
        for i, (p, a, b) in enumerate(zip(prompts, ours, theirs)):
            print(f"  {i + 1:4d} {len(p):7d} {a:13.2f} {b:14.2f}")
        mean_a, mean_b = statistics.mean(ours), statistics.mean(theirs)
        print(f"  mean ttft: mlxkv {mean_a:.2f} s, mlx-lm LRUPromptCache {mean_b:.2f} s, ratio mlx-lm/mlxkv {mean_b / mean_a:.2f}x")
        # Restart: new tiers over the same directory (RAM empty), the conversation's last prompt again.
        last = prompts[-1]
        restarted = run_ours(binding, [last], directory, args.gen_tokens)[0]
        cold = run_ours(binding, [last], Path(cold_scratch), args.gen_tokens)[0]
        print(f"  after restart, turn {args.turns} again ({len(last)} tokens): mlxkv {restarted:.2f} s vs cold prefill {cold:.2f} s ({cold / restarted:.0f}x)")


if __name__ == "__main__":
    main()

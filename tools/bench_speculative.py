"""Decode tok/s without speculation, with prompt lookup and with a draft model, in one run, on an
edit workload and a chat workload (targets: >= 2x on edits with prompt lookup, >= 0.95x on chat).

    edit   the prompt holds a ~600-token Python file and asks for it back with a few changes; the
           answer re-emits most of it, which is where prompt-lookup drafts pay
    chat   plain questions, answered in prose (few n-grams to reuse: the adaptive draft length
           should switch speculation off rather than lose time)

The draft model is the model's own first `--draft-layers` layers (self-speculation, as in
LayerSkip: no smaller model with SmolLM2's tokenizer ships here). `--model` runs it on a local
mlx-lm directory or .gguf file instead of the embedded model: the edit target assumes an answer
that rewrites the file with a few changes, which the embedded 135M model does not give (it
paraphrases), so a model that does is the fair check. Every mode must produce the very
tokens of the plain run (checked: a mismatch exits 1). Decode tok/s is the generation's own (first
token to last). Each repeat runs every request once in every mode, back to back; a mode's speed-up
is the median over repeats of its workload tok/s (tokens over decode seconds, all the workload's
requests) against the plain run's in the same repeat, so the pairs see the same load (this shared
machine's speed drifts 1.5x between minutes); per request, the median of its paired ratios.
Then prompt lookup is replayed on the plain runs' tokens for each `--replay-ngram` (rounds needed
and a speed-up modelled from the measured step costs: no timing noise, for comparing proposers).
`--base` (implied by `--model gemma3-270m`, the `gemma3` group's base model) words the workloads
for a base model, which has no chat template and continues text: an edit prompt is the file, the
change asked for, and the opening of the changed file; a chat prompt is the start of the prose.
Run: `uv run python -m tools.bench_speculative` (add `--cpu-kernels mlx` for MLX's own kernels,
`--temperature T` for seeded sampling instead of greedy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from mlxkv_inference import Generation, GenerationParams, MlxAutoregressiveBinding, SamplingParams, load_binding  # first: the BLAS shim precedes mlx

from mlxkv.paths import default_cache_dir  # noqa: E402, I001
from mlxkv_inference.generation.results import GenerationResult
from mlxkv_inference.models.gemma3_270m import gemma3_270m_path
from mlxkv_inference.speculative.proposers import PromptLookup
from mlxkv_inference.speculative.speculation import SpeculativeParams
from mlxkv_inference.step_costs import StepCosts
from tools.bench_generate import cpu_model
from mlxkv_inference.speculative.speculator import Speculator
from mlxkv_inference.models.draft import layer_skip_draft
from mlxkv_inference.tokenizer.chat import encode_chat

CODE_FILE = '''\
"""A small inventory service: items, stock levels and reorder rules."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0
    tags: list[str] = field(default_factory=list)

    def total_value(self) -> float:
        return self.price * self.quantity


class Inventory:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}

    def add_item(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"item {item.sku} already exists")
        self.items[item.sku] = item

    def remove_item(self, sku: str) -> Item:
        if sku not in self.items:
            raise KeyError(f"no item {sku}")
        return self.items.pop(sku)

    def restock(self, sku: str, amount: int) -> None:
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.items[sku].quantity += amount

    def sell(self, sku: str, amount: int) -> float:
        item = self.items[sku]
        if amount > item.quantity:
            raise ValueError(f"only {item.quantity} of {sku} left")
        item.quantity -= amount
        return item.price * amount

    def total_value(self) -> float:
        return sum(item.total_value() for item in self.items.values())

    def low_stock(self, threshold: int = 5) -> list[Item]:
        return [item for item in self.items.values() if item.quantity < threshold]

    def by_tag(self, tag: str) -> list[Item]:
        return [item for item in self.items.values() if tag in item.tags]


def reorder_list(inventory: Inventory, threshold: int = 5, target: int = 20) -> dict[str, int]:
    """How many of each low item to order to bring it back to `target`."""
    return {item.sku: target - item.quantity for item in inventory.low_stock(threshold)}
'''

SEED = 1234  # sampled runs: every mode draws with the same seed, so the same tokens

EDIT_REQUESTS = [
    "Rewrite this file with the method `sell` renamed to `sell_units`. Output the whole file.",
    "Rewrite this file with the class `Inventory` renamed to `Warehouse`. Output the whole file.",
]
CHAT_REQUESTS = [
    "Explain how photosynthesis works to a ten year old.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
]
# The same work for a base model: it copies the file with the change, or continues the prose.
BASE_EDIT_CHANGES = ["renaming `restock` to `add_stock`", "renaming `Inventory` to `Warehouse`"]
BASE_CHAT_OPENINGS = [
    "Photosynthesis, explained to a ten year old. Plants are like little kitchens:",
    "The lighthouse keeper found the bottle on a grey morning, wedged between two rocks.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description="decode tok/s with and without speculative decoding (edit and chat workloads)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate per answer (default: 256)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every request in every mode, back to back; speed-ups are medians of each repeat's (default: 3)")
    parser.add_argument("--num-draft-tokens", type=int, default=8, help="the most drafts a step verifies (default: 8)")
    parser.add_argument("--replay-ngram", type=int, nargs="*", default=[3, 8], metavar="N",
                        help="also replay prompt lookup with n-grams up to N on the plain runs' tokens, without timing "
                             "(default: 3 8)")
    parser.add_argument("--draft-layers", type=int, default=4, help="layers of the self-speculation draft (default: 4)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature, seeded (default: 0, greedy); the tokens must still match")
    parser.add_argument("--cpu-kernels", choices=("native", "mlx"), default="native", help="matmul kernels (default: native)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a local mlx-lm directory or .gguf file, or gemma3-270m (the `gemma3` group's base model; "
                             "implies --base) (default: the embedded model)")
    parser.add_argument("--base", action="store_true", help="prompts for a base model: raw text it continues, no chat template")
    args = parser.parse_args()
    if args.model == "gemma3-270m":
        args.model, args.base = str(gemma3_270m_path(default_cache_dir())), True
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.max_tokens < 2:
        parser.error(f"--max-tokens must be at least 2 (decode tok/s runs from the first token to the last), got {args.max_tokens}")
    binding = load_binding(args.model, cpu_kernels=args.cpu_kernels)
    sampling = SamplingParams(temperature=args.temperature, seed=SEED if args.temperature else None)
    try:
        draft = layer_skip_draft(binding, args.draft_layers)
    except ValueError as error:  # the range depends on the model loaded
        parser.error(f"--draft-layers: {error}")
    binding.warm_up(compiled=True)  # the server's start-up probes (compiled rounds too), outside the timed runs
    modes = {
        "off": SpeculativeParams(),
        "prompt_lookup": SpeculativeParams(mode="prompt_lookup", num_draft_tokens=args.num_draft_tokens),
        f"draft({args.draft_layers} layers)": SpeculativeParams(mode="draft", num_draft_tokens=args.num_draft_tokens),
    }
    workloads = base_workloads(binding) if args.base else {
        "edit": chat_prompts(binding, [f"```python\n{CODE_FILE}```\n\n{request}" for request in EDIT_REQUESTS]),
        "chat": chat_prompts(binding, CHAT_REQUESTS),
    }
    print(f"cpu {cpu_model()}, {os.cpu_count()} cores; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{binding.model_id}, {args.cpu_kernels} kernels, "
          f"{f'temperature {args.temperature} (seed {SEED})' if args.temperature else 'greedy'}, up to {args.max_tokens} tokens an answer, "
          f"{args.repeats} repeats, up to {args.num_draft_tokens} drafts a step")
    exact = True
    window = binding.config.get("sliding_window")
    for workload, prompts in workloads.items():
        print(f"\n{workload}: prompts of {', '.join(str(len(p)) for p in prompts)} tokens"
              + (f" (sliding window {window})" if window else ""))
        tps: dict[str, list[float]] = {mode: [] for mode in modes}  # each run's, repeat by repeat, request by request
        workload_tps: dict[str, list[float]] = {mode: [] for mode in modes}  # each repeat's
        drafted: dict[str, int] = {mode: 0 for mode in modes}
        accepted: dict[str, int] = {mode: 0 for mode in modes}
        tokens: dict[str, int] = {mode: 0 for mode in modes}
        answers: list[tuple[int, ...]] = []
        for _ in range(args.repeats):
            decoded = {mode: 0 for mode in modes}
            seconds = {mode: 0.0 for mode in modes}
            for prompt in prompts:
                reference: tuple[int, ...] | None = None
                for mode, spec in modes.items():
                    result = _run(binding, draft, prompt, spec, args.max_tokens, sampling)
                    if reference is None:
                        reference = result.token_ids
                        if len(answers) < len(prompts):
                            answers.append(reference)
                    elif result.token_ids != reference:
                        print(f"  MISMATCH: {mode} produced other tokens than the plain run", file=sys.stderr)
                        exact = False
                    tps[mode].append(result.decode_tps)
                    if result.decode_tps > 0:  # decode_tps: the tokens after the first over their seconds
                        decoded[mode] += result.generated_tokens - 1
                        seconds[mode] += (result.generated_tokens - 1) / result.decode_tps
                    drafted[mode] += result.draft_tokens
                    accepted[mode] += result.accepted_tokens
                    tokens[mode] += result.generated_tokens
            for mode in modes:
                workload_tps[mode].append(decoded[mode] / seconds[mode] if seconds[mode] else 0.0)
        for mode in modes:
            rate = f"{accepted[mode] / drafted[mode]:.0%} of {drafted[mode]} drafts" if drafted[mode] else "no drafts"
            paired = [x / off if off else 0.0 for x, off in zip(workload_tps[mode], workload_tps["off"])]
            own = [statistics.median(x / off if off else 0.0 for x, off in zip(tps[mode][i :: len(prompts)], tps["off"][i :: len(prompts)]))
                   for i in range(len(prompts))]
            print(f"  {mode:>20}: {statistics.median(workload_tps[mode]):6.2f} tok/s  {statistics.median(paired):5.2f}x  "
                  f"(repeats {', '.join(f'{r:.2f}x' for r in paired)}; per request {', '.join(f'{r:.2f}x' for r in own)}; "
                  f"accepted {rate}; {tokens[mode]} tokens; runs {[round(x, 1) for x in tps[mode]]})")
        for n in args.replay_ngram:
            replays = [replay(prompt, list(answer), n, args.num_draft_tokens, binding.step_costs)
                       for prompt, answer in zip(prompts, answers)]
            print(f"  replayed, n-grams up to {n}: rounds {', '.join(str(r) for r, _ in replays)}; "
                  f"modelled {', '.join(f'{x:.2f}x' for _, x in replays)}")
    costs = binding.step_costs
    ceiling = max(((k + 1) / costs.relative(k + 1), k) for k in range(1, args.num_draft_tokens + 1))
    print(f"\nan answer that copies its prompt throughout: modelled {ceiling[0]:.2f}x "
          f"({ceiling[1]} drafts a round, all accepted; a round of {ceiling[1] + 1} positions measured "
          f"{costs.relative(ceiling[1] + 1):.2f} steps)")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("\nevery mode produced the plain run's tokens" if exact else "\nSPECULATION CHANGED TOKENS")
    return 0 if exact else 1


def chat_prompts(binding: MlxAutoregressiveBinding, requests: list[str]) -> list[list[int]]:
    return [encode_chat(binding.tokenizer, [{"role": "user", "content": r}]).tokens for r in requests]


def base_workloads(binding: MlxAutoregressiveBinding) -> dict[str, list[list[int]]]:
    # NOTE: the file's first half (~320-token prompts), so that 150-token answers stay inside Gemma 3's
    # 512-token sliding window, where rounds run (past it steps are single: docs/speculative.md).
    # Worded as a file's before and after: with "the same file, with ..." the 270M base model writes
    # new code sooner. It copies the opening and the imports, then writes code of its own.
    code = CODE_FILE[: CODE_FILE.index("    def sell")]
    edits = [f"# inventory.py (before)\n```python\n{code}```\n\n# inventory.py (after {change})\n```python\n"
             for change in BASE_EDIT_CHANGES]
    return {"edit": [binding.tokenizer.encode(e) for e in edits], "chat": [binding.tokenizer.encode(c) for c in BASE_CHAT_OPENINGS]}


def replay(prompt: list[int], answer: list[int], ngram_max: int, num_draft_tokens: int, costs: StepCosts) -> tuple[int, float]:
    """(rounds, modelled speed-up) of prompt lookup with n-grams up to `ngram_max` and the adaptive
    length drafting `answer` (the plain run's tokens) after `prompt`: no model runs, so no timing
    noise; a round of k drafts costs what `costs` (this run's measured forwards) say 1 + k
    positions cost against one."""
    params = SpeculativeParams(mode="prompt_lookup", num_draft_tokens=num_draft_tokens, ngram_max=ngram_max)
    speculator = Speculator(params, PromptLookup(params.ngram_min, ngram_max), costs)
    at, rounds, cost = 0, 0, 0.0
    while at < len(answer):
        drafts = speculator.drafts(prompt + answer[: at + 1], min(num_draft_tokens, len(answer) - at - 1))
        accepted = 0
        while accepted < len(drafts) and answer[at + 1 + accepted] == drafts[accepted]:
            accepted += 1
        speculator.observe(drafts, answer[at + 1 : at + 2 + accepted])
        rounds, cost, at = rounds + 1, cost + costs.relative(1 + len(drafts)), at + 1 + accepted
    return rounds, len(answer) / cost


def _run(binding: MlxAutoregressiveBinding, draft: MlxAutoregressiveBinding, prompt: list[int], spec: SpeculativeParams,
         max_tokens: int, sampling: SamplingParams) -> GenerationResult:
    params = GenerationParams(max_tokens=max_tokens, speculative=spec, sampling=sampling)
    return Generation(binding, prompt, params, draft=draft).run()


if __name__ == "__main__":
    sys.exit(main())

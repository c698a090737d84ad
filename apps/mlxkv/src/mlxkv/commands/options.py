"""Options shared by subcommands that load a model and generate (names follow mlx-lm's)."""

from __future__ import annotations

import argparse
import logging

from pathlib import Path

from mlxkv.paths import DEFAULT_SSD_BYTES, default_cache_dir, default_ram_cache_bytes, parse_size, parse_size_or_zero
from mlxkv_inference import DEFAULT_PREFILL_CHUNK, DEFAULT_QUANTIZED_KV_START, GenerationParams, KvScheme, SamplingParams
from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference._blas import blas_description
from mlxkv_inference.batch_exactness import BATCH_EXACTNESS, RELAXED_NOTICE, check_batch_exactness
from mlxkv_inference.speculative.speculation import (
    DEFAULT_NUM_DRAFT_TOKENS, MAX_NUM_DRAFT_TOKENS, SPECULATIVE_MODES, SpeculativeMode, SpeculativeParams,
)
from mlxkv_inference.models.draft import check_draft_tokenizer, layer_skip_draft
from mlxkv_inference.native.kernels import (
    CPU_KERNELS, CpuKernels, check_cpu_kernels, default_cpu_kernels, describe_cpu_kernels,
)


def add_model_options(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """`several`: --model may be given more than once (`serve`), as NAME=SOURCE or SOURCE."""
    group = parser.add_argument_group("model")
    source = ("a local mlx-lm model directory, a .gguf file, or a Hugging Face id (org/name: from the hub cache, "
              "downloaded unless HF_HUB_OFFLINE=1)")
    group.add_argument(
        "--model",
        metavar="[NAME=]SOURCE" if several else "SOURCE",
        action="append" if several else "store",
        default=None,
        help=f"{source}; repeat it to serve several models, each request served by the one its 'model' names "
        "('embedded' is the embedded model) (default: the embedded SmolLM2-135M-Instruct Q4_1)" if several
        else f"{source} (default: the embedded SmolLM2-135M-Instruct Q4_1)",
    )
    group.add_argument("--kv-bits", type=int, choices=(4, 8), default=None, help="quantize the KV cache to this many bits")
    group.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64, help="KV quantization group size (default: 64)")
    group.add_argument(
        "--quantized-kv-start",
        type=int,
        default=DEFAULT_QUANTIZED_KV_START,
        metavar="N",
        help="with --kv-bits: full-precision KV until the cache holds N tokens, quantized from then on "
        f"(default: {DEFAULT_QUANTIZED_KV_START}, as mlx-lm)",
    )
    group.add_argument(
        "--cpu-kernels",
        choices=CPU_KERNELS,
        default=default_cpu_kernels(),
        help="quantized matmuls on the CPU: mlxkv's native multi-threaded, batch-invariant kernel, or MLX's own "
        f"(default: {default_cpu_kernels()}; native needs Linux with mlxkv-cpu-kernels)",
    )
    group.add_argument(
        "--batch-exactness",
        choices=BATCH_EXACTNESS,
        default="strict",
        help="strict: sequences decode in one batch only where the kernels are probed row-invariant, so tokens never "
        "depend on the other requests; relaxed: batch through any kernel, as other servers do (more throughput where "
        "a kernel is not row-invariant; its KV is cached under its own identity) (default: strict)",
    )
    group.add_argument(
        "--no-compiled-decode",
        dest="compiled_decode",
        action="store_false",
        help="run every decode step through the ordinary graph instead of the compiled single-token step",
    )


def add_sampling_options(parser: argparse.ArgumentParser, *, default_max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", "-m", type=int, default=default_max_tokens, help=f"most tokens to generate (default: {default_max_tokens})")
    group.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1, off)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p times the top probability (default: 0, off)")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="multiplicative penalty on recent tokens (default: 1, off)")
    group.add_argument("--presence-penalty", type=float, default=0.0, help="additive penalty on tokens seen recently (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="additive penalty per recent occurrence (default: 0)")
    group.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one, printed in the stats line)")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop when TEXT is generated (repeatable)")
    add_prefill_option(group)


def add_prefill_option(group: argparse._ArgumentGroup, default: int = DEFAULT_PREFILL_CHUNK, why: str = "") -> None:
    group.add_argument(
        "--prefill-step-size",
        type=int,
        default=default,
        metavar="N",
        help=f"prompt tokens per prefill chunk{why} (default: {default})",
    )


def add_speculative_options(parser: argparse.ArgumentParser, *, server: bool) -> None:
    group = parser.add_argument_group("speculative decoding (the tokens are exactly those of not speculating)")
    default = "the requests' default" if server else "the default"
    group.add_argument("--speculative", choices=SPECULATIVE_MODES, default=None,
                       help=f"{default} proposer: prompt_lookup drafts what followed an earlier occurrence (the best-aligned recent one) of the "
                       "last few tokens (pays when the answer repeats the prompt: edits, quotes); draft uses the draft "
                       "model; off (default: prompt_lookup, or draft when a draft model is given)")
    group.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS, metavar="K",
                       help=f"the most drafts one step verifies, in [1, {MAX_NUM_DRAFT_TOKENS}]; the adaptive length picks "
                       f"up to K from each sequence's acceptance rate (default: {DEFAULT_NUM_DRAFT_TOKENS})")
    draft = group.add_mutually_exclusive_group()
    draft.add_argument("--draft-model", metavar="PATH", default=None,
                       help="draft model for --speculative draft: a local mlx-lm directory or .gguf with the same tokenizer")
    draft.add_argument("--draft-layers", type=int, default=None, metavar="N",
                       help="draft with the model's own first N layers (self-speculation; no second model to load)")


def speculative_params_from(args: argparse.Namespace) -> SpeculativeParams:
    has_draft = args.draft_model is not None or args.draft_layers is not None
    mode: SpeculativeMode = args.speculative or ("draft" if has_draft else "prompt_lookup")
    if mode == "draft" and not has_draft:
        raise ValueError("--speculative draft needs --draft-model PATH or --draft-layers N")
    return SpeculativeParams(mode=mode, num_draft_tokens=args.num_draft_tokens)


def prepare_speculation(args: argparse.Namespace, target: MlxAutoregressiveBinding) -> MlxAutoregressiveBinding | None:
    """Probe, before the first request, whether `target` can verify drafts exactly (see
    `verifies_positions`; with compiled decode, the compiled rounds too: ~0.4 s for the embedded
    model that the first round would wait for); return the draft model --draft-model or
    --draft-layers names."""
    if speculative_params_from(args).enabled:
        target.warm_up(compiled=args.compiled_decode)
    if args.draft_layers is not None:
        return layer_skip_draft(target, args.draft_layers)
    if args.draft_model is None:
        return None
    from mlxkv_inference import load_binding

    draft = load_binding(args.draft_model, cpu_kernels=target.cpu_kernels)
    check_draft_tokenizer(target, draft)
    return draft


def apply_batch_exactness(args: argparse.Namespace, binding: MlxAutoregressiveBinding) -> None:
    """Before any cache tier is built: relaxed KV is keyed by its own fingerprint."""
    binding.use_batch_exactness(check_batch_exactness(args.batch_exactness))
    if binding.batch_exactness == "relaxed":
        logging.getLogger("mlxkv").warning(RELAXED_NOTICE)


def cpu_kernels_from(args: argparse.Namespace) -> CpuKernels:
    return check_cpu_kernels(args.cpu_kernels)


def runtime_info(binding: MlxAutoregressiveBinding | None, kernels: CpuKernels = "mlx",
                 exactness: str = "strict") -> dict[str, str]:
    """The matmul kernels, BLAS and batch exactness in use, for the start-up line and /health
    (`kernels`, `exactness`: those models will load with, when none is loaded yet)."""
    return {"cpu_kernels": describe_cpu_kernels(binding.cpu_kernels if binding is not None else kernels),
            "blas": blas_description(), "batch_exactness": binding.batch_exactness if binding is not None else exactness}


def runtime_line(binding: MlxAutoregressiveBinding) -> str:
    info = runtime_info(binding)
    return f"cpu kernels {info['cpu_kernels']}; BLAS {info['blas']}; batch exactness {info['batch_exactness']}"


def kv_scheme_from(args: argparse.Namespace) -> KvScheme:
    return KvScheme(bits=args.kv_bits, group_size=args.kv_group_size, quantized_start=args.quantized_kv_start)


def base_params_from(args: argparse.Namespace) -> GenerationParams:
    """What every request of `serve` runs with, beside its own sampling and limits."""
    return GenerationParams(prefill_chunk=args.prefill_step_size, compiled_decode=args.compiled_decode,
                            speculative=speculative_params_from(args))


def generation_params_from(args: argparse.Namespace) -> GenerationParams:
    sampling = SamplingParams(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )
    return GenerationParams(
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop=tuple(args.stop),
        prefill_chunk=args.prefill_step_size,
        compiled_decode=args.compiled_decode,
        speculative=speculative_params_from(args),
    )


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prompt cache")
    group.add_argument("--prompt-cache-bytes", type=parse_size_or_zero, default=default_ram_cache_bytes(), metavar="SIZE",
                       help="RAM prompt cache cap; 0 keeps nothing in RAM (default: a quarter of RAM, at most 8G; "
                       "here %(default)s bytes)")
    group.add_argument("--ssd-cache", type=Path, default=default_cache_dir(), metavar="DIR",
                       help=f"SSD KV cache directory, kept across restarts (default: {default_cache_dir()})")
    group.add_argument("--no-ssd-cache", dest="ssd_cache", action="store_const", const=None,
                       help="keep the prompt cache in RAM only")
    group.add_argument("--ssd-cache-max", type=parse_size, default=DEFAULT_SSD_BYTES, metavar="SIZE",
                       help="SSD cache size cap; least recently used entries go first (default: 20G)")

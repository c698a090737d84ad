"""`mlxkv serve` with several models: the options, and the router that loads each on demand."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from mlxkv_inference import load_binding
from mlxkv_inference.models.embedded import embedded_model_path

from mlxkv.commands.adapter_options import AdapterOption, allowed_adapter_dirs, bind_adapters, load_adapters
from mlxkv.commands.options import apply_batch_exactness, cpu_kernels_from, kv_scheme_from
from mlxkv.engine.cache_services import token_kv_bytes
from mlxkv.engine.measured import MemoryGauge
from mlxkv.engine.memory import MemoryBudget, WeightSizes, default_memory_budget
from mlxkv.engine.model_sources import discover_cached, hub_offline, is_hub_id, parse_model_specs, resolve_source
from mlxkv.engine.models import BoundAdapter, LoadedModel, ModelPolicy, ModelRouter, ModelSpec
from mlxkv.engine.models.eviction import CLOSE_TIMEOUT_S
from mlxkv.paths import parse_size, weights_digest_memo


def add_models_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several models (give --model more than once, or --models-dir) and the memory budget")
    group.add_argument("--models-dir", type=Path, default=None, metavar="DIR",
                       help="serve every mlx-lm directory and .gguf file in DIR, each named by its directory or file name")
    group.add_argument("--default-model", default=None, metavar="NAME",
                       help="with several models: the one that serves a request naming none of them "
                       "(default: such a request gets 404)")
    group.add_argument("--max-models", type=int, default=None, metavar="N",
                       help="with several models: most loaded at once; a request for another unloads the least recently "
                       "used idle one (its SSD KV stays) (default: all of them)")
    group.add_argument("--pin", action="append", default=[], metavar="NAME",
                       help="load this model at start-up and never unload it (repeatable)")
    group.add_argument("--model-ttl", type=float, default=0.0, metavar="SECONDS",
                       help="with several models: unload a model idle for SECONDS (default: 0, never)")
    group.add_argument("--memory-budget", type=parse_size, default=None, metavar="SIZE",
                       help="memory the process may hold: the loaded model(s) (weights and RAM prompt cache) and the running "
                       "requests' KV (prompt + max_tokens each) are planned against it, and what the process really holds "
                       "(RSS, MLX's buffers) counts where it is more than planned. Over it, MLX's buffer cache and the RAM "
                       "prompt cache are let go first; a load then unloads idle models or gets 503, a request waits for "
                       "running ones or gets 503 naming the numbers, or 400 when its KV could never fit; /health shows the "
                       f"figures (default: three quarters of RAM, here {default_memory_budget() >> 20} MiB)")


def several_models(args: argparse.Namespace) -> list[ModelSpec] | None:
    """The registered models when there are several (None: one model, served as before)."""
    specs = parse_model_specs(list(args.model or []), args.models_dir)
    if len(specs) < 2:
        for option in ("default_model", "max_models"):
            if getattr(args, option) is not None:
                raise ValueError(f"--{option.replace('_', '-')} is for several models: give --model more than once or --models-dir")
        if args.pin or args.model_ttl:
            raise ValueError("--pin and --model-ttl are for several models: give --model more than once or --models-dir")
        return None
    if args.max_models is not None and args.max_models < 1:
        raise ValueError(f"--max-models={args.max_models} must be >= 1")
    if not args.model_ttl >= 0:
        raise ValueError(f"--model-ttl={args.model_ttl} must be >= 0 seconds (0: never)")
    if args.draft_model is not None:
        raise ValueError("--draft-model drafts for one model; with several, use --draft-layers N (each model drafts with its own)")
    return specs


def memory_budget(args: argparse.Namespace, gauge: MemoryGauge) -> MemoryBudget:
    """--memory-budget against the plan and what `gauge` reads of the process."""
    return MemoryBudget(args.memory_budget if args.memory_budget is not None else default_memory_budget(), gauge)


def build_router(args: argparse.Namespace, specs: list[ModelSpec], gauge: MemoryGauge) -> ModelRouter:
    """The router over `specs`: each model's RAM tier gets an equal share of --prompt-cache-bytes
    among the --max-models loaded at once, its SSD store an equal share of --ssd-cache-max."""
    from mlxkv.commands.serve import build_engine  # serve imports this module

    max_models = args.max_models if args.max_models is not None else len(specs)
    ram_share: int = args.prompt_cache_bytes // max_models
    per_model = argparse.Namespace(**{**vars(args), "prompt_cache_bytes": ram_share,
                                      "ssd_cache_max": args.ssd_cache_max // len(specs)})

    adapters = bind_adapters(args.adapter, [s.name for s in specs], args.default_model)
    specs = [replace(s, adapters=tuple(BoundAdapter(a.name, a.path) for a in adapters[s.name])) for s in specs]
    # NOTE: read now: loading an mlx-lm directory sets HF_HUB_OFFLINE for mlx-lm's own lookups
    offline = hub_offline()

    weights = WeightSizes()

    def estimate(spec: ModelSpec) -> int:
        path = resolve_source(spec.source, offline=offline)
        return weights.planned(spec.name, path if path is not None else embedded_model_path()) + ram_share

    def load(spec: ModelSpec) -> LoadedModel:
        path = resolve_source(spec.source, offline=offline)
        hub = spec.source is not None and is_hub_id(spec.source)
        binding = load_binding(path, kv_scheme_from(args), cpu_kernels_from(args), digest_memo=weights_digest_memo(),
                               model_id=spec.source if hub else None)
        apply_batch_exactness(args, binding)
        weights.loaded(spec.name, binding.weight_bytes)
        engine = build_engine(per_model, binding)
        try:
            # those of the command line and those clients added; one for another model fails this load
            load_adapters(per_model, engine.adapters, [AdapterOption(a.name, a.path) for a in spec.adapters])
        except Exception:
            engine.close(CLOSE_TIMEOUT_S)
            raise
        return LoadedModel(engine, estimate(spec), token_kv_bytes(binding), engine.context_length,
                           binding.tokenizer.vocab_size, engine.close)

    policy = ModelPolicy(max_models, pinned=tuple(args.pin), default=args.default_model, ttl_s=args.model_ttl,
                         adapter_dirs=allowed_adapter_dirs(args))
    return ModelRouter(specs, load, policy, budget=memory_budget(args, gauge), estimate=estimate, discover=discover_cached)

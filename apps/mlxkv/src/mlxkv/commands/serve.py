"""`mlxkv serve`: the OpenAI- and Anthropic-compatible HTTP server (a drop-in for mlx_lm.server)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Generator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from mlxkv_inference import MlxAutoregressiveBinding, load_binding
from mlxkv_inference.models.embedded import EMBEDDED_MODEL_ID, embedded_model_path
from mlxkv_inference.scheduler.batch import DEFAULT_MAX_BATCH
from mlxkv_inference.scheduler.decode_step import STEP_MAX_ROWS
from mlxkv_serve import ServeConfig, ServeEngine, bounded_http_protocol, build_app
from mlxkv_serve.config import loopback_hosts
from mlxkv_inference.batch_exactness import check_batch_exactness
from mlxkv_remote_cache import safe_url
from mlxkv_serve.responses_store import DiskResponseStore, MemoryResponseStore, ResponseStore

from mlxkv.commands.adapter_options import add_adapter_options, check_unbound, load_adapters
from mlxkv.commands.options import (
    add_cache_options, add_model_options, add_prefill_option, add_speculative_options, apply_batch_exactness, base_params_from,
    cpu_kernels_from, kv_scheme_from, prepare_speculation, runtime_info, speculative_params_from,
)
from mlxkv.commands.serve_models import add_models_options, build_router, memory_budget, several_models
from mlxkv.engine.budgeted import BudgetedEngine
from mlxkv.engine.cache_services import build_tiers, token_kv_bytes
from mlxkv.engine.measured import PROCESS_MEMORY, MemoryGauge
from mlxkv.engine.memory import weights_on_disk
from mlxkv.engine.model_sources import is_hub_id, resolve_source
from mlxkv.engine.local_engine import DEFAULT_MAX_QUEUE, LocalEngine
from mlxkv.engine.remote_tier import RemoteColdTier, remote_store_opener
from mlxkv.paths import parse_hours, parse_size, weights_digest_memo

log = logging.getLogger("mlxkv.serve")
SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 64
# Small chunks bound how long a new request waits behind a long prefill: one chunk, which costs
# more as the prompt's context grows (64 tokens: ~0.3 s at the start of a prompt, ~1 s at 2,000
# tokens, here), hence also the time bound. On this CPU, 24- to 64-token chunks prefill about as
# fast as 512-token ones.
SERVE_PREFILL_CHUNK = 64
SERVE_PREFILL_STEP_MS = 100.0


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI- and Anthropic-compatible HTTP API",
        description="Serve the model on /v1/chat/completions, /v1/completions, /v1/messages and /v1/models, "
        "with /health, /metrics, /v1/cache/stats and /admin/cache/flush. The prompt cache keeps KV in RAM "
        "and on the SSD, across restarts.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require this key (Authorization: Bearer KEY or x-api-key: KEY) on every route but /health")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN", dest="cors_origins",
                        help="let web pages from ORIGIN (e.g. https://chat.example.com) call the API from a browser; "
                        "repeat for more; '*' lets any page the user opens call it (mlx_lm.server's behaviour). Pages "
                        "from localhost, 127.0.0.1 and [::1] on any port may always")
    parser.add_argument("--max-tokens", type=int, default=512, help="max tokens when a request gives none (default: 512)")
    parser.add_argument("--temp", type=float, default=0.0, help="temperature when a request gives none (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p when a request gives none (default: 1)")
    parser.add_argument("--max-body-bytes", type=parse_size, default=4 << 20, metavar="SIZE",
                        help="largest accepted request body (default: 4M); larger ones get 413")
    parser.add_argument("--generation-checkpoint", type=int, default=32, metavar="N",
                        help="with the SSD cache: checkpoint every generation every N tokens, so an identical request "
                        "after a crash or restart continues where it stopped (default: 32; 0 turns it off); with --draft-model the "
                        "draft's caches are checkpointed too, in a share of --ssd-cache-max by what a token's KV costs each model")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                        help="most requests waiting behind the running generations; more get 429 with Retry-After "
                        f"(default: {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                        help="most generations decoded together, each token exactly what it would be alone "
                        f"(default: {DEFAULT_MAX_BATCH}; 1 runs one generation at a time)")
    parser.add_argument("--max-batch-kv", type=parse_size, default=0, metavar="SIZE",
                        help="KV memory the running generations may plan for (prompt + max_tokens each); a request "
                        "that would pass it waits (default: no limit; a request alone always runs)")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S, metavar="SECONDS",
                        help="close a connection whose request (headers and body) is not fully read within this time "
                        f"(default: {DEFAULT_REQUEST_TIMEOUT_S:.0f})")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                        help=f"open connections beyond which requests get 503 (default: {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--checkpoint-ttl", type=parse_hours, default=24.0, metavar="HOURS",
                        help="delete a generation checkpoint not rewritten for HOURS, such as one a cancelled or failed "
                        "generation left behind; checkpoints also count in --ssd-cache-max (default: 24)")
    parser.add_argument("--remote-cache", default=None, metavar="URL",
                        help="share prompt KV and generation checkpoints with other replicas through Redis or Valkey "
                        "(redis://host:port/db; rediss://user:password@host:port for TLS and an ACL user) or S3 "
                        "(s3://bucket/prefix; endpoint, region and credentials as boto3 reads them, or "
                        "?endpoint=URL&region=NAME). It sits under --ssd-cache: what another replica stored is read "
                        "from there, kept on this SSD and restored; a store that does not answer is a cold cache "
                        "(/health says degraded) (default: off)")
    parser.add_argument("--remote-cache-hmac-key-file", type=Path, default=None, metavar="FILE",
                        help="with --remote-cache: sign what this replica stores with the key in FILE (HMAC-SHA256, "
                        "at least 16 bytes) and treat unsigned or badly signed entries as misses; for a store shared "
                        "beyond one trust domain (every replica needs the same key)")
    parser.add_argument("--keep-billing-header", action="store_true",
                        help="keep Claude Code's x-anthropic-billing-header system block in prompts (it changes on "
                             "every request, so no prompt would reuse the cache past it; default: left out)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="server log verbosity (default: info)")
    add_model_options(parser, several=True)
    add_models_options(parser)
    prefill = parser.add_argument_group("prefill")
    add_prefill_option(prefill, SERVE_PREFILL_CHUNK, "; also the most prompt tokens one scheduler step prefills")
    prefill.add_argument("--prefill-step-ms", type=float, default=SERVE_PREFILL_STEP_MS, metavar="MS",
                         help="size prompt chunks so a step's prefill takes about MS milliseconds, which is how long "
                         "the running generations wait for their next token during a long prefill (a new request stops "
                         "the chunk between two layers instead; the tokens do not change); 0 turns it off "
                         f"(default: {SERVE_PREFILL_STEP_MS:g})")
    add_speculative_options(parser, server=True)
    add_cache_options(parser)
    add_adapter_options(parser, server=True)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_args(args)
    engine, vocab_size, runtime = load_engine(args)
    config = ServeConfig(
        vocab_size=vocab_size, default_max_tokens=args.max_tokens, default_temperature=args.temp,
        default_top_p=args.top_p, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        allowed_hosts=loopback_hosts(args.host), cors_origins=tuple(args.cors_origins), cpu_kernels=runtime["cpu_kernels"],
        blas=runtime["blas"], batch_exactness=runtime["batch_exactness"], keep_billing_header=args.keep_billing_header,
    )
    app = build_app(engine, config, response_store(args))
    where = args.ssd_cache if args.ssd_cache is not None else "off"
    if args.remote_cache:
        where = f"{where}, shared through {safe_url(args.remote_cache)}"
    log.info("serving %s on http://%s:%d (SSD cache: %s; cpu kernels %s; BLAS %s; batch exactness %s)", engine.model_id,
             args.host, args.port, where, runtime["cpu_kernels"], runtime["blas"], runtime["batch_exactness"])
    # NOTE: lifespan off: the app has no start-up or shutdown work (`run` closes the engine), and a
    # lifespan task cancelled by a SIGTERM is logged by Starlette as an ERROR traceback.
    server = GracefulServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=int(SHUTDOWN_TIMEOUT_S),
        lifespan="off", http=bounded_http_protocol(args.request_timeout), limit_concurrency=args.max_connections,
    ))
    try:
        server.run()
    finally:
        engine.close(SHUTDOWN_TIMEOUT_S)
        log.info("prompt cache flushed; bye")
    # NOTE: everything durable is fsynced by now. Exiting without interpreter teardown avoids an
    # abort in MLX's destructors for per-thread streams ("terminate called without an active
    # exception"), seen when a second signal forces the shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if server.started else 1)


def load_engine(args: argparse.Namespace, gauge: MemoryGauge = PROCESS_MEMORY) -> tuple[ServeEngine, int, dict[str, str]]:
    """The engine, the vocabulary size requests are checked against, and the runtime for /health:
    one model loaded now, or several behind a router that loads each on demand. `gauge` reads
    the process's memory for the budget."""
    specs = several_models(args)
    if specs is not None:
        router = build_router(args, specs, gauge)
        try:
            router.load_pinned()
        except RuntimeError:
            router.close(SHUTDOWN_TIMEOUT_S)
            raise
        # each model checks a request's token ids against its own vocabulary
        return router, 1 << 31, runtime_info(None, cpu_kernels_from(args), check_batch_exactness(args.batch_exactness))
    check_unbound(args.adapter)
    source = args.model[0] if args.model else None
    path = resolve_source(source)
    budget = memory_budget(args, gauge)
    on_disk = weights_on_disk(path or embedded_model_path())
    budget.check_model(source or EMBEDDED_MODEL_ID, on_disk, args.prompt_cache_bytes)
    binding = load_binding(path, kv_scheme_from(args), cpu_kernels_from(args), digest_memo=weights_digest_memo(),
                           model_id=source if source and is_hub_id(source) else None)
    apply_batch_exactness(args, binding)
    engine = build_engine(args, binding)
    load_adapters(args, engine.adapters)
    weights = max(on_disk, binding.weight_bytes)  # widened tensors hold more
    budgeted = BudgetedEngine(engine, budget, resident=weights + args.prompt_cache_bytes, kv_per_token=token_kv_bytes(binding),
                              context_length=engine.context_length)
    return budgeted, binding.tokenizer.vocab_size, runtime_info(binding)


def check_args(args: argparse.Namespace) -> None:
    """Refuse settings that cannot work before the model loads (seconds) rather than after."""
    if args.generation_checkpoint < 0:
        raise ValueError(f"--generation-checkpoint={args.generation_checkpoint} must be >= 0 (0 turns it off)")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the option out to serve without one")
    for name in ("max_queue", "max_batch", "max_connections", "prefill_step_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not args.prefill_step_ms >= 0:
        raise ValueError(f"--prefill-step-ms={args.prefill_step_ms} must be >= 0 (0 turns it off)")
    if args.remote_cache is not None and args.ssd_cache is None:
        raise ValueError("--remote-cache sits under the SSD cache: give --ssd-cache DIR (or leave out --no-ssd-cache)")
    if args.remote_cache_hmac_key_file is not None and args.remote_cache is None:
        raise ValueError("--remote-cache-hmac-key-file signs remote entries: give --remote-cache too")
    if args.remote_cache is not None:
        remote_store_opener(args.remote_cache, args.remote_cache_hmac_key_file)  # a bad URL or key: refused now
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout={args.request_timeout} must be > 0 seconds")
    speculative_params_from(args)


def response_store(args: argparse.Namespace) -> ResponseStore:
    """Stored responses (`store: true`) live beside the SSD cache and outlive a restart; without one, in memory."""
    if args.ssd_cache is None:
        return MemoryResponseStore()
    return DiskResponseStore(args.ssd_cache / "responses")


def build_engine(args: argparse.Namespace, binding: MlxAutoregressiveBinding) -> LocalEngine:
    """The engine `serve` runs, with the command line's cache, checkpoint, queue and generation settings."""
    # the probes the scheduler and speculation use, before the first request
    binding.warm_up(compiled=args.compiled_decode, rows=STEP_MAX_ROWS)
    draft = prepare_speculation(args, binding)
    remote = remote_store_opener(args.remote_cache, args.remote_cache_hmac_key_file) if args.remote_cache else None
    tiers, cold = build_tiers(binding, ram_bytes=args.prompt_cache_bytes, ssd_dir=args.ssd_cache, ssd_bytes=args.ssd_cache_max,
                              checkpoint_ttl_s=args.checkpoint_ttl * 3600, draft=draft if args.generation_checkpoint else None,
                              remote=remote)
    return LocalEngine(binding, tiers, ssd=cold, remote=cold if isinstance(cold, RemoteColdTier) else None,
                       checkpoint_every=args.generation_checkpoint, base_params=base_params_from(args),
                       max_queue=args.max_queue, max_batch=args.max_batch,
                       max_batch_kv_bytes=args.max_batch_kv, draft=draft,
                       prefill_step_s=args.prefill_step_ms / 1000)


class GracefulServer(uvicorn.Server):
    """SIGTERM/SIGINT: stop accepting, let open responses finish (up to the timeout), return.

    NOTE: uvicorn's own handler re-raises the signal once it has stopped, which would kill the
    process before the prompt cache is flushed; this one returns so `run` can flush and exit 0.
    A second signal forces the exit.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        def stop(signum: int, frame: FrameType | None) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)



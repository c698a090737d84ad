"""`--adapter NAME=PATH` (repeatable) for `serve` and `generate`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mlxkv.engine.adapters import AdapterRegistry, parse_adapter_option

log = logging.getLogger(__name__)


def add_adapter_options(parser: argparse.ArgumentParser, *, server: bool) -> None:
    how = ("a request selects it by its model (NAME or <model id>:NAME, NAME+NAME2 to stack) or by mlx_lm.server's "
           "'adapters' field" if server else "given twice or more, the adapters are stacked in order")
    group = parser.add_argument_group("adapters")
    group.add_argument(
        "--adapter", action="append", type=parse_adapter_option, default=[], metavar="NAME=PATH",
        help=f"an mlx-lm LoRA/DoRA adapter directory (adapter_config.json, adapters.safetensors), repeatable; {how}")
    if server:
        group.add_argument("--adapter-dir", action="append", type=Path, default=[], metavar="DIR",
                           help="let clients load adapters from under DIR with POST /v1/adapters (behind --api-key), "
                           "repeatable (default: none, the route answers 403)")


def load_adapters(args: argparse.Namespace, registry: AdapterRegistry) -> None:
    """Load the command line's adapters (an unreadable one, or one for another model, stops the command)."""
    registry.allowed_dirs = tuple(d.expanduser().resolve() for d in getattr(args, "adapter_dir", []))
    for name, path in args.adapter:
        named = registry.add(name, path)
        log.info("adapter %s: %s (%s, rank %d, %d layers; cache namespace %s)", name, path, named.adapter.kind,
                 named.adapter.rank, len(named.adapter.layers), named.adapter.digest[:8])

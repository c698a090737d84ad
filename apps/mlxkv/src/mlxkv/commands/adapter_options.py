"""`--adapter NAME=PATH` (repeatable) for `serve` and `generate`."""

from __future__ import annotations

import argparse
import logging

from mlxkv.engine.adapters import AdapterRegistry, parse_adapter_option

log = logging.getLogger(__name__)


def add_adapter_options(parser: argparse.ArgumentParser, *, server: bool) -> None:
    how = ("a request selects it by its model (NAME or <model id>:NAME, NAME+NAME2 to stack) or by mlx_lm.server's "
           "'adapters' field" if server else "given twice or more, the adapters are stacked in order")
    parser.add_argument_group("adapters").add_argument(
        "--adapter", action="append", type=parse_adapter_option, default=[], metavar="NAME=PATH",
        help=f"an mlx-lm LoRA/DoRA adapter directory (adapter_config.json, adapters.safetensors), repeatable; {how}")


def load_adapters(args: argparse.Namespace, registry: AdapterRegistry) -> None:
    """Load the command line's adapters (an unreadable one, or one for another model, stops the command)."""
    for name, path in args.adapter:
        named = registry.add(name, path)
        log.info("adapter %s: %s (%s, rank %d, %d layers; cache namespace %s)", name, path, named.adapter.kind,
                 named.adapter.rank, len(named.adapter.layers), named.adapter.digest[:8])

"""`--adapter NAME=PATH` (repeatable) for `serve` and `generate`; with several models `serve`
binds each adapter to one: `--adapter MODEL:NAME=PATH` (a bare NAME=PATH goes to --default-model)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxkv.engine.adapters import AdapterRegistry, check_name, parse_adapter_option

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdapterOption:
    """One `--adapter`: `model` is the registered model it is bound to (None: the one served)."""

    name: str
    path: Path
    model: str | None = None


def add_adapter_options(parser: argparse.ArgumentParser, *, server: bool) -> None:
    how = ("a request selects it by its model (NAME or <model id>:NAME, NAME+NAME2 to stack) or by mlx_lm.server's "
           "'adapters' field; with several models, MODEL:NAME=PATH binds it to the model MODEL (a request names it "
           "MODEL:NAME) and NAME=PATH to --default-model" if server else "given twice or more, the adapters are stacked in order")
    group = parser.add_argument_group("adapters")
    group.add_argument(
        "--adapter", action="append", type=_argument(parse_bound_adapter if server else _plain_adapter), default=[],
        metavar="[MODEL:]NAME=PATH" if server else "NAME=PATH",
        help=f"an mlx-lm LoRA/DoRA adapter directory (adapter_config.json, adapters.safetensors), repeatable; {how}")
    if server:
        group.add_argument("--adapter-dir", action="append", type=Path, default=[], metavar="DIR",
                           help="let clients load adapters from under DIR with POST /v1/adapters (behind --api-key), "
                           "repeatable (default: none, the route answers 403)")


def parse_bound_adapter(value: str) -> AdapterOption:
    """`[MODEL:]NAME=PATH`; ValueError naming the bad value."""
    named, sep, path = value.partition("=")
    model, colon, name = named.rpartition(":")
    if not sep or not path or (colon and not model):
        raise ValueError(f"--adapter takes NAME=PATH or MODEL:NAME=PATH, not {value!r}")
    return AdapterOption(check_name(name), Path(path).expanduser(), model or None)


def bind_adapters(options: list[AdapterOption], models: list[str], default: str | None) -> dict[str, list[AdapterOption]]:
    """Each registered model's adapters (several models); ValueError for an adapter bound to no
    registered model, or a bare one without --default-model."""
    bound: dict[str, list[AdapterOption]] = {name: [] for name in models}
    for option in options:
        model = option.model or default
        if model is None:
            raise ValueError(f"--adapter {option.name}={option.path}: with several models, bind it to one "
                             f"(--adapter MODEL:{option.name}=PATH, MODEL one of {', '.join(models)}) or set --default-model")
        if model not in bound:
            raise ValueError(f"--adapter {model}:{option.name}: no model is registered as {model!r} "
                             f"(registered: {', '.join(models)})")
        bound[model].append(option)
    return bound


def check_unbound(options: list[AdapterOption]) -> None:
    """One model: an adapter bound to a model by name is a mistake (ValueError)."""
    for option in options:
        if option.model is not None:
            raise ValueError(f"--adapter {option.model}:{option.name}=...: MODEL: binds an adapter to one of several "
                             f"models; with one --model give {option.name}=PATH")


def load_adapters(args: argparse.Namespace, registry: AdapterRegistry, options: list[AdapterOption] | None = None) -> None:
    """Load `options` (default: the command line's adapters) into `registry`; an unreadable one,
    or one for another model, raises (`AdapterLoadError`, `AdapterMismatchError`)."""
    registry.allowed_dirs = allowed_adapter_dirs(args)
    for option in args.adapter if options is None else options:
        named = registry.add(option.name, option.path)
        log.info("adapter %s: %s (%s, rank %d, %d layers; cache namespace %s)", option.name, option.path, named.adapter.kind,
                 named.adapter.rank, len(named.adapter.layers), named.adapter.digest[:8])


def allowed_adapter_dirs(args: argparse.Namespace) -> tuple[Path, ...]:
    """The `--adapter-dir`s (symlinks resolved): clients load adapters from under these only."""
    return tuple(d.expanduser().resolve() for d in getattr(args, "adapter_dir", []))


def _plain_adapter(value: str) -> AdapterOption:
    name, path = parse_adapter_option(value)
    return AdapterOption(name, path)


def _argument(parse: Callable[[str], AdapterOption]) -> Callable[[str], AdapterOption]:
    """`parse` for argparse: its ValueError's message is the error shown (not "invalid value")."""
    def parse_argument(value: str) -> AdapterOption:
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse_argument

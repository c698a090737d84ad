"""`mlxkv` command line: one subcommand per module under `mlxkv.commands`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mlxkv_state.errors import StateError

from mlxkv import __version__
from mlxkv.commands import cache, generate, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxkv",
        description="mlxkv: a local LLM server on MLX whose KV state is durable. "
        "Runs offline on an embedded SmolLM2-135M-Instruct model by default.",
    )
    parser.add_argument("--version", action="version", version=f"mlxkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    generate.register(sub)
    serve.register(sub)
    cache.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as e:
        print(f"mlxkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except StateError as e:
        print(f"mlxkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())

"""`mlxkv cache ls|inspect|verify|gc|clear`: look after the SSD KV cache directory."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from mlxkv_ssd_cache import read_header
from mlxkv_ssd_cache.maintenance import EntrySummary, clear, gc, kv_files, summarize, verify

from mlxkv.paths import default_cache_dir, parse_size
from mlxkv.progress import TerminalProgress


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "cache",
        help="inspect and maintain the SSD KV cache",
        description="Inspect and maintain the SSD KV cache directory. Only mlxkv's own files "
        "(*.mlxkv, their .tmp orphans, quarantine/) are ever touched.",
    )
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir(), metavar="DIR",
                        help=f"the SSD cache directory (default: {default_cache_dir()})")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("ls", help="list entries (prompt states and generation checkpoints): model, namespace, kind, tokens, size, last use").set_defaults(run=run_ls)
    inspect = actions.add_parser("inspect", help="print one KV file's header as JSON")
    inspect.add_argument("file", type=Path, metavar="FILE", help="the .mlxkv KV file to describe")
    inspect.set_defaults(run=run_inspect)
    actions.add_parser("verify", help="read every file completely and check every checksum").set_defaults(run=run_verify)
    collect = actions.add_parser("gc", help="reap orphaned .tmp files, empty the quarantine, enforce a size cap")
    collect.add_argument("--max-bytes", type=parse_size, default=None, metavar="SIZE",
                         help="evict least recently used entries until the directory holds at most SIZE (e.g. 20G)")
    collect.set_defaults(run=run_gc)
    wipe = actions.add_parser("clear", help="delete every mlxkv file in the directory")
    wipe.add_argument("--yes", action="store_true", help="confirm the deletion")
    wipe.set_defaults(run=run_clear)


def run_ls(args: argparse.Namespace) -> int:
    entries = [summarize(p) for p in kv_files(args.cache_dir)]
    print(f"{'model':32} {'ns':17} {'kind':10} {'tokens':>7} {'size':>10} {'last used':19}  file")
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))
        name = e.path.relative_to(args.cache_dir)
        note = f"  [{e.problem}]" if e.problem else ""
        print(f"{e.model_id[:32]:32} {short_namespace(e.ns):17} {_kind(e):10} {e.num_tokens:7d} {e.size:10d} {used}  {name}{note}")
    kinds = Counter(_kind(e) for e in entries)
    print(f"{len(entries)} entries ({kinds['prompt']} prompt, {kinds['checkpoint']} checkpoint, {kinds['object']} object), "
          f"{sum(e.size for e in entries)} bytes in {args.cache_dir}")
    return 0


def short_namespace(ns: str) -> str:
    """An adapter namespace as `ls` prints it: each adapter's digest cut to 8 characters ("-": the base model)."""
    return "+".join(digest[:8] for digest in ns.split("+")) if ns else "-"


def _kind(entry: EntrySummary) -> str:
    """A generation checkpoint (expires, see `mlxkv serve --checkpoint-ttl`), an object, or a prompt state."""
    if entry.has_checkpoint:
        return "checkpoint"
    return "object" if entry.num_tokens == 0 and entry.problem is None else "prompt"


def run_inspect(args: argparse.Namespace) -> int:
    header, complete = read_header(args.file)
    doc = header.to_json()
    doc["tokens"] = f"{len(header.tokens)} tokens"
    doc["complete"] = complete
    print(json.dumps(doc, indent=2))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    bad = 0
    files = list(kv_files(args.cache_dir))
    progress = TerminalProgress()
    for i, path in enumerate(files):
        progress.status(f"verifying {i + 1}/{len(files)}: {path.name}")
        problem = verify(path)
        if problem is not None:
            bad += 1
            progress.clear()
            print(f"BAD  {path}: {problem}", flush=True)
    progress.clear()
    print(f"{len(files) - bad} of {len(files)} files verified")
    return 1 if bad else 0


def run_gc(args: argparse.Namespace) -> int:
    report = gc(args.cache_dir, args.max_bytes)
    print(f"removed {report.removed_tmp} tmp files, {report.removed_quarantined} quarantined files, "
          f"evicted {report.evicted} entries; freed {report.freed_bytes} bytes")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    if not args.yes:
        count = len(list(kv_files(args.cache_dir)))
        print(f"would delete {count} entries in {args.cache_dir}; run again with --yes", file=sys.stderr)
        return 1
    print(f"deleted {clear(args.cache_dir)} files from {args.cache_dir}")
    return 0

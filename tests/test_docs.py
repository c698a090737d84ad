"""README.md and docs/ stay true to the tree: links resolve, and every command they name exists.

Model-free and fast: the `mlxkv` commands are checked against the CLI's own argparse parser (built
once), the `tools.X` commands against the tool modules' sources. `tools.check_docs` runs the
examples marked runnable.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxkv.cli import build_parser
from tools.check_docs import ROOT, SHELL_LANGUAGES, code_blocks, doc_files, runnable_blocks

DOCS = doc_files()
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_MLXKV = re.compile(r"\bmlxkv ([a-z][a-z-]*)((?: [^|#]*)?)")
_TOOL = re.compile(r"\btools\.([a-z_]+)((?: [^|#]*)?)")


def _snippets(path: Path) -> Iterator[str]:
    """Every line of code in a page: its fenced blocks' lines (comments cut off) and its inline code spans."""
    for block in code_blocks(path):
        yield from (line.split(" #")[0] for line in block.code.splitlines())  # not the comments
    prose = path.read_text(encoding="utf-8")
    for block in code_blocks(path):
        prose = prose.replace(block.code, "")
    yield from _INLINE_CODE.findall(prose)


def _github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_github_anchor(line.lstrip("#")) for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@pytest.fixture(scope="module")
def cli() -> argparse.ArgumentParser:
    return build_parser()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves_to_a_file_and_heading(path: Path) -> None:
    broken = []
    for target in _LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.is_file():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor}")
    assert broken == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_mlxkv_command_and_flag_exists(path: Path, cli: argparse.ArgumentParser) -> None:
    commands = _subparsers(cli)
    unknown = []
    for snippet in _snippets(path):
        for name, rest in _MLXKV.findall(snippet):
            if name not in commands:
                unknown.append(f"mlxkv {name}")
                continue
            parser = commands[name]
            allowed = _options(cli) | _options(parser)
            actions = _subparsers(parser)  # `mlxkv cache ACTION`: the action's own flags too
            action = next((word for word in rest.split() if word in actions), None)
            if action is not None:
                allowed |= _options(actions[action])
            unknown += [f"mlxkv {name} {flag}" for flag in _FLAG.findall(rest) if flag not in allowed]
    assert unknown == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_tool_named_exists_with_its_flags(path: Path) -> None:
    missing = []
    for snippet in _snippets(path):
        for module, rest in _TOOL.findall(snippet):
            source = ROOT / "tools" / f"{module}.py"
            if not source.is_file():
                missing.append(f"tools.{module}: no tools/{module}.py")
                continue
            text = source.read_text(encoding="utf-8")
            missing += [f"tools.{module} {flag}" for flag in _FLAG.findall(rest) if f'"{flag}"' not in text]
    assert missing == []


def test_runnable_blocks_are_shell_and_the_readme_has_one() -> None:
    blocks = runnable_blocks(DOCS)
    assert [b.where for b in blocks if b.language not in SHELL_LANGUAGES] == []
    assert any(b.path.name == "README.md" for b in blocks)


def test_readme_stays_a_short_users_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150

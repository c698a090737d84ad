"""A reasoning model's think section in an answer's grammar: where it starts, and its token budget.

    start := think answer            the prompt opened the section (R1 distills' templates)
    start := think? answer           the model may open it (Qwen3)
    think := [<think>] think_text </think> \\n*      think_text: at most `budget` tokens

When `budget` tokens of thinking are spent the grammar allows only `</think>` next: the section is
closed there (Anthropic's `thinking.budget_tokens`). The tags are written as their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# How far back the prompt's end is searched for the generation prompt's think tags.
_TAIL = 8


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """The think tags' token ids in one model's vocabulary."""

    open_id: int
    close_id: int


@dataclass(frozen=True, slots=True)
class ThinkPlan:
    """The think section an answer may start with: `opened` when the prompt opened it already,
    `budget` the most tokens it may hold (None: no bound; 0: closed at once)."""

    tags: ThinkTags
    opened: bool
    budget: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"think budget={self.budget} must be >= 0 (or None: no bound)")


def think_plan(tags: ThinkTags | None, prompt: Sequence[int], budget: int | None) -> ThinkPlan | None:
    """The plan for an answer to `prompt`; None when the model does not think or the generation
    prompt closed the section already (Qwen3 with `enable_thinking` false renders it empty)."""
    if tags is None:
        return None
    tail = list(prompt[-_TAIL:])
    last_open = max((i for i, t in enumerate(tail) if t == tags.open_id), default=-1)
    last_close = max((i for i, t in enumerate(tail) if t == tags.close_id), default=-1)
    if last_close > last_open:
        return None
    return ThinkPlan(tags, last_open >= 0 and last_open >= len(tail) - 3, budget)


def think_rules(plan: ThinkPlan | None, *, newlines: bool) -> list[str]:
    """The Lark lines of the rule `think` (none without a plan); `newlines`: the newlines after
    `</think>` belong to the section (the answer after it must not start with one)."""
    if plan is None:
        return []
    open_ = "" if plan.opened else f"<[{plan.tags.open_id}]> "
    body = "" if plan.budget == 0 else "think_text "
    lines = [f"think: {open_}{body}<[{plan.tags.close_id}]>" + (" NL?" if newlines else "")]
    if newlines:
        lines.append(r"NL: /\n\n?/")  # at most the blank line Qwen3 writes: a small model cannot pad with newlines
    if plan.budget != 0:
        limit = f"[max_tokens={plan.budget}]" if plan.budget is not None else ""
        lines.append(f"think_text{limit}: /(.|\\n)*/")
    return lines

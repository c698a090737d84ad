"""A radix tree over entries' tokens (one per namespace) that answers `PrefixIndex.longest`
without looking at every entry: the answer the linear scan gives, in time that grows with the
number of branch points along the prompt, not with the number of entries.

    root -- [1 2 3] -- [4 5]      entry A = 1 2 3 4 5
                  \\-- [9]        entry B = 1 2 3 9, entry C = 1 2 3 (at the inner node)

Every entry sits at the node where its tokens end; an edge holds the tokens between two nodes.
An entry below the prompt's path shares exactly the depth where it leaves the path with the
prompt, so (rules in reuse.py, `L` = prompt length) its usable prefix is min(depth, L - 1):

    untrimmable entries are usable only whole: they sit on the path itself, checked one by one;
    trimmable ones are found from the deepest point of the path up, through each node's
    `frontier`: the Pareto set, over its subtree's trimmable entries, of (low minimum reusable
    offset, high recency): the most recent entry allowed at a usable length u is the last point
    whose offset is <= u

NOTE: recency only ever grows to the index's newest tick (add, touch), so an insert into a
frontier drops the points it dominates and appends; only a removed frontier point makes a
node recompute from its children, and only up to the first ancestor that did not hold it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from mlxkv_inference.cache.prefix_index import Indexed

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# (minimum reusable offset, recency, entry): sorted by offset, recency rising with it
_Point = tuple[int, int, "Indexed[K, V]"]


class _Node(Generic[K, V]):
    __slots__ = ("tokens", "depth", "parent", "children", "entries", "frontier")

    def __init__(self, tokens: tuple[int, ...], depth: int, parent: _Node[K, V] | None) -> None:
        self.tokens = tokens  # any sequence whose first `depth` tokens are this node's path
        self.depth = depth
        self.parent = parent
        self.children: dict[int, _Node[K, V]] = {}
        self.entries: dict[K, Indexed[K, V]] = {}
        self.frontier: list[_Point[K, V]] = []

    def ancestry(self) -> Iterator[_Node[K, V]]:
        """This node, then each ancestor up to the root."""
        node: _Node[K, V] | None = self
        while node is not None:
            yield node
            node = node.parent

    def most_recent(self, usable: int) -> _Point[K, V] | None:
        """The most recent trimmable entry below (or at) this node allowed at `usable` tokens."""
        for point in reversed(self.frontier):
            if point[0] <= usable:
                return point
        return None


class PrefixTrie(Generic[K, V]):
    """The entries of one namespace that have tokens."""

    def __init__(self) -> None:
        self._root: _Node[K, V] = _Node((), 0, None)
        self._node_of: dict[K, _Node[K, V]] = {}

    def __len__(self) -> int:
        return len(self._node_of)

    def longest(self, prompt: tuple[int, ...]) -> tuple[Indexed[K, V], int] | None:
        """The entry with the longest usable prefix of `prompt` (ties: most recent) and its length."""
        cap = len(prompt) - 1
        best: tuple[int, int, Indexed[K, V]] | None = None
        walk = self._walk(prompt)
        for node, reached in walk:  # untrimmable entries: only whole, so only on the path
            if node.depth == reached and 1 <= node.depth <= cap:
                for entry in node.entries.values():
                    if not entry.trimmable and entry.minimum_reusable_offset <= node.depth:
                        best = max(best, (node.depth, entry.recency, entry), key=_rank)
        for node, reached in reversed(walk):  # usable only falls from here up
            usable = min(reached, cap)
            if usable < 1 or (best is not None and usable < best[0]):
                break
            point = node.most_recent(usable)
            if point is not None:
                best = max(best, (usable, point[1], point[2]), key=_rank)
        return None if best is None else (best[2], best[0])

    def strict_prefixes(self, entry: Indexed[K, V]) -> list[Indexed[K, V]]:
        """Entries whose tokens are a strict prefix of `entry`'s (it must be in the trie), shortest first."""
        path = list(self._node_of[entry.key].ancestry())
        return [e for node in reversed(path[1:]) for e in node.entries.values()]

    def add(self, entry: Indexed[K, V]) -> None:
        """Insert `entry` (its key not present), whose recency is the newest the index has given."""
        node = self._insert_path(tuple(entry.tokens))  # a tuple already, but slices must compare as one
        node.entries[entry.key] = entry
        self._node_of[entry.key] = node
        if entry.trimmable:
            self._raise(node, entry)

    def touch(self, entry: Indexed[K, V]) -> None:
        """`entry`'s recency was just made the newest."""
        if entry.trimmable:
            self._raise(self._node_of[entry.key], entry)

    def remove(self, entry: Indexed[K, V]) -> None:
        node = self._node_of.pop(entry.key)
        del node.entries[entry.key]
        for up in node.ancestry():
            if not any(point[2] is entry for point in up.frontier):
                break
            up.frontier = _pareto(up)
        self._prune(node)

    # -- internals -------------------------------------------------------------------------------
    def _walk(self, prompt: tuple[int, ...]) -> list[tuple[_Node[K, V], int]]:
        """The nodes along the prompt's path with the depth it shares with each: the root, every
        node it passes whole, then the node whose edge it leaves (or ends) in, if any."""
        node, depth = self._root, 0
        walk = [(node, 0)]
        while depth < len(prompt):
            child = node.children.get(prompt[depth])
            if child is None:
                break
            reached = _shared(child.tokens, prompt, depth, child.depth)
            walk.append((child, reached))
            if reached < child.depth:
                break
            node, depth = child, reached
        return walk

    def _insert_path(self, tokens: tuple[int, ...]) -> _Node[K, V]:
        """The node where `tokens` end, made (and an edge split) when missing."""
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf: _Node[K, V] = _Node(tokens, len(tokens), node)
                node.children[tokens[depth]] = leaf
                return leaf
            reached = _shared(child.tokens, tokens, depth, child.depth)
            if reached < child.depth:  # split the edge where the new tokens leave it
                middle: _Node[K, V] = _Node(child.tokens, reached, node)
                middle.children[child.tokens[reached]] = child
                middle.frontier = list(child.frontier)
                node.children[tokens[depth]] = middle
                child.parent = middle
                child = middle
            node, depth = child, reached
        return node

    def _raise(self, node: _Node[K, V], entry: Indexed[K, V]) -> None:
        point: _Point[K, V] = (entry.minimum_reusable_offset, entry.recency, entry)
        for up in node.ancestry():
            assert not up.frontier or up.frontier[-1][1] < entry.recency, "recency must be the newest"
            up.frontier = [p for p in up.frontier if p[0] < point[0]]
            up.frontier.append(point)

    def _prune(self, node: _Node[K, V]) -> None:
        """Drop nodes left without entries and children; merge a node left with one child into it."""
        while node.parent is not None and not node.entries and len(node.children) <= 1:
            parent = node.parent
            key = node.tokens[parent.depth]
            if node.children:
                (child,) = node.children.values()
                child.parent = parent
                parent.children[key] = child
                return
            del parent.children[key]
            node = parent


def _pareto(node: _Node[K, V]) -> list[_Point[K, V]]:
    points = [(e.minimum_reusable_offset, e.recency, e) for e in node.entries.values() if e.trimmable]
    points += [p for child in node.children.values() for p in child.frontier]
    points.sort(key=lambda p: (p[0], -p[1]))
    frontier: list[_Point[K, V]] = []
    for point in points:
        if not frontier or point[1] > frontier[-1][1]:
            frontier.append(point)
    return frontier


def _rank(candidate: tuple[int, int, Indexed[K, V]] | None) -> tuple[int, int]:
    return (-1, -1) if candidate is None else (candidate[0], candidate[1])


def _shared(path: tuple[int, ...], tokens: tuple[int, ...], start: int, end: int) -> int:
    """How far `tokens` follow `path` from `start` up to `end` (the first depth they differ)."""
    end = min(end, len(tokens))
    if path[start:end] == tokens[start:end]:
        return end
    lo, hi = start, end  # path[start:lo] == tokens[start:lo], and they differ before hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if path[lo:mid] == tokens[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo

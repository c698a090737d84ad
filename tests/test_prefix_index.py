"""`PrefixIndex`: longest usable prefix, one tie-breaking rule, supersede and LRU eviction (no model)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxkv_inference.cache.prefix_index import Indexed, PrefixIndex
from mlxkv_inference.cache.reuse import supersedes, usable_prefix


def entry(key: str, tokens: list[int], nbytes: int = 10, ns: str = "", trimmable: bool = True,
          minimum: int = 0) -> Indexed[str, str]:
    return Indexed(key, ns, tuple(tokens), nbytes, minimum, trimmable, value=key)


def keys(entries: list[Indexed[str, str]]) -> list[str]:
    return [e.key for e in entries]


def test_longest_usable_prefix_wins_and_keeps_the_last_prompt_token_to_feed() -> None:
    index: PrefixIndex[str, str] = PrefixIndex()
    index.add(entry("short", [1, 2, 9]))
    index.add(entry("long", [1, 2, 3, 4, 5]))
    index.add(entry("other-ns", [1, 2, 3, 4, 5, 6], ns="adapter"))
    found = index.longest([1, 2, 3, 4, 7], "")
    assert found is not None and (found[0].key, found[1]) == ("long", 4)
    found = index.longest([1, 2, 3, 4, 5], "")  # the whole entry: its last token is fed again
    assert found is not None and (found[0].key, found[1]) == ("long", 4)
    found = index.longest([1, 2, 9, 9], "")
    assert found is not None and (found[0].key, found[1]) == ("short", 3)
    found = index.longest([1, 2, 3, 4, 5, 6, 7], "adapter")
    assert found is not None and (found[0].key, found[1]) == ("other-ns", 6)
    assert index.longest([7, 1, 2], "") is None and index.longest([1], "") is None


def test_equal_prefixes_go_to_the_most_recently_used_entry() -> None:
    index: PrefixIndex[str, str] = PrefixIndex()
    index.add(entry("a", [1, 2, 3, 10]))
    index.add(entry("b", [1, 2, 3, 20]))
    index.add(entry("c", [1, 2, 3, 30]))
    found = index.longest([1, 2, 3, 99, 5], "")
    assert found is not None and (found[0].key, found[1]) == ("c", 3)
    index.touch("a")
    found = index.longest([1, 2, 3, 99, 5], "")
    assert found is not None and found[0].key == "a"
    index.touch("b")
    found = index.longest([1, 2, 3, 99, 5], "")
    assert found is not None and found[0].key == "b"


def test_untrimmable_and_minimum_offset_entries_are_only_used_as_allowed() -> None:
    index: PrefixIndex[str, str] = PrefixIndex()
    index.add(entry("ring", [1, 2, 3, 4], trimmable=False))
    index.add(entry("quantized", [5, 6, 7, 8, 9], minimum=3))
    assert index.longest([1, 2, 3, 7], "") is None  # would need the ring trimmed
    found = index.longest([1, 2, 3, 4, 0], "")
    assert found is not None and (found[0].key, found[1]) == ("ring", 4)
    assert index.longest([5, 6, 0], "") is None  # below the conversion point
    found = index.longest([5, 6, 7, 0], "")
    assert found is not None and (found[0].key, found[1]) == ("quantized", 3)


def test_add_supersedes_trimmable_ancestors_of_its_namespace_only() -> None:
    index: PrefixIndex[str, str] = PrefixIndex()
    index.add(entry("p2", [1, 2]))
    index.add(entry("p3", [1, 2, 3]))  # supersedes p2
    index.add(entry("sibling", [1, 2, 4]))
    index.add(entry("ns-p2", [1, 2], ns="adapter"))
    index.add(entry("object", []))  # no tokens: never superseded
    superseded = index.add(entry("p5", [1, 2, 3, 4, 5]))
    assert keys(superseded) == ["p3"]
    assert keys(index.lru_order()) == ["sibling", "ns-p2", "object", "p5"]
    assert index.add(entry("wrapped", [1, 2, 3, 4, 5, 6], trimmable=False)) == []  # cannot serve p5
    assert index.add(entry("q", [1, 2, 3, 4, 5, 6, 7], minimum=7)) == []  # cannot trim down to either
    assert index.nbytes == 60


def test_same_key_replaces_the_entry_and_its_bytes() -> None:
    index: PrefixIndex[str, str] = PrefixIndex()
    index.add(entry("a", [1, 2, 3], nbytes=10))
    index.add(entry("b", [7, 8], nbytes=5))
    assert index.add(entry("a", [1, 2, 3], nbytes=40)) == []
    assert (len(index), index.nbytes, keys(index.lru_order())) == (2, 45, ["b", "a"])


def test_eviction_removes_least_recently_used_first_and_never_the_kept_key() -> None:
    index: PrefixIndex[str, str] = PrefixIndex()
    for i, name in enumerate(["e0", "e1", "e2", "e3", "e4"]):
        index.add(entry(name, [100 + i, 1], nbytes=10))
    index.touch("e0")  # order now: e1 e2 e3 e4 e0
    found = index.longest([102, 1, 5], "")  # a lookup alone does not change recency
    assert found is not None and found[0].key == "e2"
    assert keys(index.evict_to(30)) == ["e1", "e2"]
    assert keys(index.evict_to(10, keep="e3")) == ["e4", "e0"]
    assert keys(index.lru_order()) == ["e3"] and index.nbytes == 10
    assert keys(index.evict_to(0, keep="e3")) == []
    assert keys(index.evict_to(0)) == ["e3"] and index.nbytes == 0


# -- the radix tree against the linear scan it replaced ------------------------------------------
class LinearIndex:
    """The reference: every rule of `PrefixIndex` as a scan over all entries."""

    def __init__(self) -> None:
        self.entries: dict[str, Indexed[str, str]] = {}
        self.clock = 0

    def longest(self, prompt: list[int], ns: str) -> tuple[str, int] | None:
        best: tuple[Indexed[str, str], int] | None = None
        for e in self.entries.values():
            if e.ns != ns or not e.tokens:
                continue
            usable = usable_prefix(e.tokens, prompt, e.minimum_reusable_offset, e.trimmable)
            if usable and (best is None or (usable, e.recency) > (best[1], best[0].recency)):
                best = (e, usable)
        return None if best is None else (best[0].key, best[1])

    def add(self, e: Indexed[str, str]) -> set[str]:
        self.entries.pop(e.key, None)
        self.clock += 1
        e.recency = self.clock
        self.entries[e.key] = e
        gone = {old.key for old in self.entries.values() if old.ns == e.ns and old.tokens and e.tokens
                and supersedes(e.tokens, e.trimmable, e.minimum_reusable_offset, old.tokens)}
        for key in gone:
            del self.entries[key]
        return gone

    def touch(self, key: str) -> None:
        if key in self.entries:
            self.clock += 1
            self.entries[key].recency = self.clock

    def evict_to(self, budget: int) -> list[str]:
        out = []
        for e in sorted(self.entries.values(), key=lambda e: e.recency):
            if sum(x.nbytes for x in self.entries.values()) <= budget:
                break
            del self.entries[e.key]
            out.append(e.key)
        return out


_tokens = st.lists(st.integers(0, 2), max_size=6)
_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 5), _tokens, st.sampled_from(["", "x"]), st.booleans(), st.integers(0, 4)),
    st.tuples(st.just("touch"), st.integers(0, 5)),
    st.tuples(st.just("remove"), st.integers(0, 5)),
    st.tuples(st.just("evict"), st.integers(0, 80)),
    st.tuples(st.just("find"), _tokens, st.sampled_from(["", "x"])),
), max_size=40)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(_ops)
def test_lookups_supersedes_and_evictions_match_the_linear_scan(ops: list[tuple[Any, ...]]) -> None:
    index: PrefixIndex[str, str] = PrefixIndex()
    reference = LinearIndex()
    probes = [[0, 1, 2, 0, 1, 2, 0, 1], [0, 0, 0, 0, 0, 0], [1, 2], [2, 2, 2, 1, 0], [0], []]
    for op in ops:
        if op[0] == "add":
            _, k, tokens, ns, trimmable, minimum = op
            superseded = {e.key for e in index.add(entry(f"k{k}", tokens, 10, ns, trimmable, minimum))}
            assert superseded == reference.add(entry(f"k{k}", tokens, 10, ns, trimmable, minimum))
        elif op[0] == "touch":
            index.touch(f"k{op[1]}")
            reference.touch(f"k{op[1]}")
        elif op[0] == "remove":
            index.remove(f"k{op[1]}")
            reference.entries.pop(f"k{op[1]}", None)
        elif op[0] == "evict":
            assert keys(index.evict_to(op[1])) == reference.evict_to(op[1])
        else:
            probes.append(op[1])
        assert sorted(e.key for e in index.lru_order()) == sorted(reference.entries)
        for prompt in probes:
            for ns in ("", "x"):
                found = index.longest(prompt, ns)
                assert (None if found is None else (found[0].key, found[1])) == reference.longest(prompt, ns)


def test_removing_the_newest_entry_of_a_branch_falls_back_to_the_next_newest() -> None:
    index: PrefixIndex[str, str] = PrefixIndex()
    for name, tokens in [("b", [0, 2]), ("c", [0, 0]), ("a", [0, 1])]:
        index.add(entry(name, tokens))
    found = index.longest([0, 1, 2], "")
    assert found is not None and (found[0].key, found[1]) == ("a", 2)
    index.remove("a")
    found = index.longest([0, 1, 2], "")  # b and c share one token with the prompt; c is newer
    assert found is not None and (found[0].key, found[1]) == ("c", 1)
    index.touch("b")
    found = index.longest([0, 1, 2], "")
    assert found is not None and (found[0].key, found[1]) == ("b", 1)

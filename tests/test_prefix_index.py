"""`PrefixIndex`: longest usable prefix, one tie-breaking rule, supersede and LRU eviction (no model)."""

from __future__ import annotations

from mlxkv_inference.cache.prefix_index import Indexed, PrefixIndex


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

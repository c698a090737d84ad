"""The merges of a SentencePiece vocabulary: every split of a normal piece into two pieces, ranked
by the piece's score (highest first), then by the ids of its halves.

`spm_merges` finds the splits with array arithmetic: a polynomial hash (mod 2**64) of every
prefix and suffix of every piece, looked up in a bucketed table of the pieces' hashes, each match
then confirmed code point by code point; pieces have distinct hashes (checked), so no split is lost or
invented. `spm_merges_by_lookup` is the plain loop, one dict lookup per split (about a second for
Gemma's 1.1M splits); it is the reference, and it runs where the arrays do not apply (a repeated
piece, a piece over 64 characters, two pieces with one hash, a score that is NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["spm_merges", "spm_merges_by_lookup"]

_NORMAL = 1  # llama.cpp token type: a piece merges may produce
_BASE = np.uint64(0x100000001B3)  # odd, so no power of it is 0 mod 2**64
_MIX = np.uint64(0x9E3779B97F4A7C15)
_BUCKET_BITS = 20
_SHIFT = np.uint64(64 - _BUCKET_BITS)
_MAX_WIDTH = 64

Splits = tuple[np.ndarray, np.ndarray, np.ndarray]  # (piece id, left id, right id) of each split


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
               vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two known pieces, by the piece's score (highest first),
    then by the ids of its halves: the list `spm_merges_by_lookup` gives (`vocab`: piece -> id)."""
    if not len(tokens) == len(scores) == len(types):
        raise ValueError(f"a vocabulary of {len(tokens)} pieces has {len(scores)} scores and {len(types)} types")
    costs = -np.asarray(scores, dtype=np.float64)
    found = _splits(tokens, types) if len(vocab) == len(tokens) and not np.isnan(costs).any() else None
    if found is None:
        return spm_merges_by_lookup(tokens, scores, types, vocab)
    owners, lefts, rights = found
    order = _order(costs[owners], lefts, rights, len(tokens))
    piece = tokens.__getitem__
    return list(zip(map(piece, lefts[order].tolist()), map(piece, rights[order].tolist())))


def spm_merges_by_lookup(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                         vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The same merges, one dict lookup per split (`vocab`: piece -> id, the last id of a repeated piece)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score, kind in zip(tokens, scores, types, strict=True):
        if kind != _NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _splits(tokens: Sequence[str], types: Sequence[int]) -> Splits | None:
    """The splits of every normal piece, in no particular order; None where the arrays do not apply."""
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    width = int(lengths.max(initial=0))
    if width > _MAX_WIDTH or width == 0:
        return None
    points = np.array(tokens, dtype=f"<U{width}").view(np.uint32).reshape(len(tokens), width)
    rows = np.flatnonzero((np.asarray(types) == _NORMAL) & (lengths >= 2))
    rows = rows[np.argsort(-lengths[rows], kind="stable")]  # longest first: the rows cut at k are a prefix
    whole, row, cut, head = _hashes(points, lengths, rows)
    table = _table(whole)
    if table is None:
        return None  # two pieces with one hash: the lookup could not tell them apart
    left = _lookup(head, table)
    found = np.flatnonzero(left >= 0)
    row, cut, left, head = row[found], cut[found], left[found], head[found]
    powers = np.ones(width + 1, dtype=np.uint64)  # _BASE**k mod 2**64, k = 0..width
    powers[1:] = np.cumprod(np.full(width, _BASE, dtype=np.uint64))
    end = lengths[row]
    # hash(s[cut:end]) = hash(s[:end]) - hash(s[:cut]) * _BASE**(end - cut), all mod 2**64
    right = _lookup(whole[row] - head * powers[end - cut], table)
    found = np.flatnonzero(right >= 0)
    row, cut, left, right = row[found], cut[found], left[found], right[found]
    same = _confirmed(points, lengths, row, cut, left, right)
    return row[same], left[same], right[same]


def _hashes(points: np.ndarray, lengths: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """(hash of every piece, then for every cut of `rows` (longest first): its row, the cut, and
    the hash of the piece's first `cut` code points). hash(s) = sum (s[i] + 1) * _BASE**(len - 1 - i)."""
    columns = np.ascontiguousarray(points.T)
    hashes = np.zeros(points.shape[0], dtype=np.uint64)
    whole = np.zeros(points.shape[0], dtype=np.uint64)
    cut_rows: list[np.ndarray] = []
    cut_hashes: list[np.ndarray] = []
    longer = np.searchsorted(-lengths[rows], -np.arange(1, points.shape[1] + 1))  # rows longer than k, k = 1..width
    for k in range(points.shape[1]):
        hashes *= _BASE
        hashes += columns[k]
        hashes += np.uint64(1)
        ending = lengths == k + 1
        whole[ending] = hashes[ending]
        cut_rows.append(rows[: longer[k]])
        cut_hashes.append(hashes[cut_rows[-1]])
    cuts = np.repeat(np.arange(1, points.shape[1] + 1), [len(r) for r in cut_rows])
    return whole, np.concatenate(cut_rows), cuts, np.concatenate(cut_hashes)


def _order(costs: np.ndarray, lefts: np.ndarray, rights: np.ndarray, pieces: int) -> np.ndarray:
    """The order of (cost, left, right), lexicographic: one sort of one int64 key where it fits."""
    if pieces**3 >= 2**63:
        order: np.ndarray = np.lexsort((rights, lefts, costs))
        return order
    rank = np.unique(costs, return_inverse=True)[1].astype(np.int64)  # -0.0 and 0.0: one rank, as == has it
    return np.argsort((rank * pieces + lefts) * pieces + rights)


@dataclass(frozen=True, slots=True)
class _Table:
    """The pieces by hash, bucketed by the top bits of the hash times `_MIX` (the bare hash of a
    short piece is a small number; the product spreads them, and being odd, `_MIX` keeps them apart)."""

    keys: np.ndarray  # mixed hashes, sorted
    ids: np.ndarray  # the piece of each key
    starts: np.ndarray  # the first key of each bucket, then len(keys)


def _table(whole: np.ndarray) -> _Table | None:
    """None where two pieces share a hash."""
    mixed = whole * _MIX
    ids = np.argsort(mixed)
    keys = mixed[ids]
    if np.any(keys[1:] == keys[:-1]):
        return None
    starts = np.searchsorted(keys >> _SHIFT, np.arange(2**_BUCKET_BITS + 1, dtype=np.uint64))
    return _Table(keys, ids, starts)


def _lookup(hashes: np.ndarray, table: _Table) -> np.ndarray:
    """The id of the piece with each hash, or -1: each query walks its bucket (a few keys at most)."""
    mixed = hashes * _MIX
    bucket = (mixed >> _SHIFT).astype(np.int64)
    at, stop = table.starts[bucket], table.starts[bucket + 1]
    found = np.full(len(hashes), -1, dtype=np.int64)
    pending = np.flatnonzero(at < stop)
    while len(pending):
        hit = table.keys[at[pending]] == mixed[pending]
        found[pending[hit]] = table.ids[at[pending[hit]]]
        pending = pending[~hit]
        at[pending] += 1
        pending = pending[at[pending] < stop[pending]]
    return found


def _confirmed(points: np.ndarray, lengths: np.ndarray, row: np.ndarray, cut: np.ndarray, left: np.ndarray,
               right: np.ndarray) -> np.ndarray:
    """Whether piece `row` really is piece `left` then piece `right`, split at `cut` (bool per
    split; the splits come sorted by cut). Past its length a piece's code points are 0, so with
    the lengths equal, whole rows compare."""
    width = points.shape[1]
    out: np.ndarray = (lengths[left] == cut) & (lengths[right] == lengths[row] - cut)
    starts = np.searchsorted(cut, np.arange(1, width + 1))
    for k in range(1, width):
        part = slice(starts[k - 1], starts[k])
        out[part] &= np.all(points[left[part], :k] == points[row[part], :k], axis=1)
        out[part] &= np.all(points[right[part], : width - k] == points[row[part], k:], axis=1)
    return out

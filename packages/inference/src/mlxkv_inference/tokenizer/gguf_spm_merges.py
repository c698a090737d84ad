"""The merges of a SentencePiece vocabulary: every split of a normal piece into two pieces, ranked
by the piece's score (highest first), then by the ids of its halves.

`spm_merges` finds the splits with array arithmetic: a polynomial hash (mod 2**64) of every
prefix and suffix of every piece, looked up among the hashes of the pieces, each match then
confirmed code point by code point; pieces have distinct hashes (checked), so no split is lost or
invented. `spm_merges_by_lookup` is the plain loop, one dict lookup per split (about a second for
Gemma's 1.1M splits); it is the reference, and it runs where the arrays do not apply (a repeated
piece, a piece over 64 characters, two pieces with one hash).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["spm_merges", "spm_merges_by_lookup"]

_NORMAL = 1  # llama.cpp token type: a piece merges may produce
_BASE = np.uint64(0x100000001B3)  # odd, so no power of it is 0 mod 2**64
_MAX_WIDTH = 64

Splits = tuple[np.ndarray, np.ndarray, np.ndarray]  # (piece id, left id, right id) of each split


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
               vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two known pieces, by the piece's score (highest first),
    then by the ids of its halves: the list `spm_merges_by_lookup` gives (`vocab`: piece -> id)."""
    if not len(tokens) == len(scores) == len(types):
        raise ValueError(f"a vocabulary of {len(tokens)} pieces has {len(scores)} scores and {len(types)} types")
    found = _splits(tokens, types) if len(vocab) == len(tokens) else None
    if found is None:
        return spm_merges_by_lookup(tokens, scores, types, vocab)
    owners, lefts, rights = found
    order = np.lexsort((rights, lefts, -np.asarray(scores, dtype=np.float64)[owners]))
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
    by_hash = np.argsort(whole, kind="stable")
    table = whole[by_hash]
    if np.any(table[1:] == table[:-1]):
        return None  # two pieces with one hash: the lookup below could not tell them apart
    left = _lookup(head, table, by_hash)
    found = np.flatnonzero(left >= 0)
    row, cut, left, head = row[found], cut[found], left[found], head[found]
    powers = np.ones(width + 1, dtype=np.uint64)  # _BASE**k mod 2**64, k = 0..width
    powers[1:] = np.cumprod(np.full(width, _BASE, dtype=np.uint64))
    end = lengths[row]
    # hash(s[cut:end]) = hash(s[:end]) - hash(s[:cut]) * _BASE**(end - cut), all mod 2**64
    right = _lookup(whole[row] - head * powers[end - cut], table, by_hash)
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


def _lookup(hashes: np.ndarray, table: np.ndarray, by_hash: np.ndarray) -> np.ndarray:
    """The id of the piece with each hash, or -1."""
    order = np.argsort(hashes)  # sorted queries walk the table in order (numpy narrows each search by the last)
    at = np.empty(len(hashes), dtype=np.int64)
    at[order] = np.minimum(np.searchsorted(table, hashes[order]), len(table) - 1)
    found: np.ndarray = np.where(table[at] == hashes, by_hash[at], -1)
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

"""`--batch-exactness`: whether batched decode may run through kernels whose rows depend on their
batch neighbours.

strict   (default) a batched step runs only where every matmul kind of the model is probed
         row-invariant (`native.batched.rows_invariant`); otherwise every row runs its own graph, so
         a sequence's tokens never depend on what else the server runs.
relaxed  rows batch wherever the graph can be driven batched, probe or not, as other servers do:
         more throughput where a kernel's arithmetic depends on the batch (e.g. a BLAS that picks
         its kernel by the number of rows), at the price of tokens that may change with the
         neighbours. The KV it computes gets its own identity (`exactness_fingerprint`).
"""

from __future__ import annotations

import hashlib
from typing import Literal

BatchExactness = Literal["strict", "relaxed"]
BATCH_EXACTNESS: tuple[BatchExactness, ...] = ("strict", "relaxed")
RELAXED_NOTICE = ("batch exactness relaxed: batched rows may run through kernels whose results depend on the "
                  "other rows of the batch, so a sequence's tokens can change with what else runs")


def check_batch_exactness(mode: str) -> BatchExactness:
    if mode not in BATCH_EXACTNESS:
        raise ValueError(f"batch exactness {mode!r} is not one of {', '.join(BATCH_EXACTNESS)}")
    return mode


def exactness_fingerprint(fingerprint: str, mode: BatchExactness) -> str:
    """The config fingerprint of KV computed under `mode`: strict keeps the fingerprint it always
    had (strict KV is what a sequence computes alone); relaxed KV may hold a neighbour's influence,
    so neither a strict server nor a strict checkpoint may take it for theirs."""
    if mode == "strict":
        return fingerprint
    return hashlib.sha256(f"{fingerprint}|batch_exactness={mode}".encode()).hexdigest()[:32]

"""Instruction samples placed into rows of seq_len positions: first-fit decreasing (FFD).

A sample of n tokens fills n - 1 positions of a row (its inputs are its first n - 1 tokens, its
labels its last n - 1). FFD takes the samples longest first and puts each into the first row
with room; on the samples of one step it uses at most 11/9 of the optimal number of rows + 6/9
(Dósa 2007), and on instruction data (many short samples to fill the gaps) it is within a row or
two of the bound sum(positions) / seq_len.

Training rows are packed per step so that the data position stays a count of samples: a step
starting at sample position p takes the longest prefix of the sample stream p, p+1, ... that FFD
places into global_batch rows. The rows depend only on (the stream, seq_len, global_batch), not on
the mesh: every rank computes the same rows and takes its dp slice, and a resume at sample
position p, on any mesh, packs the same rows.
"""

from __future__ import annotations

import numpy as np


def first_fit_decreasing(sizes: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Rows of items (each row: indices into `sizes`, longest first) for items of `sizes`
    positions, each at most `capacity`: items longest first (ties in the given order), each into
    the first row with room for it."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if len(sizes) and (sizes.max() > capacity or sizes.min() < 1):
        got = f"{sizes.min()}..{sizes.max()}"
        raise ValueError(f"item sizes must lie in [1, {capacity}], got {got}")
    room = np.empty(len(sizes), dtype=np.int64)  # free positions of each open row
    rows: list[list[int]] = []
    for i in np.argsort(-sizes, kind="stable"):
        size = sizes[i]
        fits = room[: len(rows)] >= size
        j = int(fits.argmax()) if len(rows) and fits.any() else len(rows)
        if j == len(rows):
            rows.append([])
            room[j] = capacity
        rows[j].append(int(i))
        room[j] -= size
    return [np.asarray(r, dtype=np.int64) for r in rows]


def fill_rows(sizes: np.ndarray, capacity: int, rows: int) -> tuple[int, list[np.ndarray]]:
    """(k, the rows) for the longest prefix sizes[:k] that FFD places into `rows` rows (rows left
    empty are returned empty). `sizes` must hold at least `rows` items and more positions than
    rows x capacity, or all of the stream there is.

    Binary search on k: FFD is not monotone in general (one more item can, rarely, save a row), so
    this finds a k that fits with k + 1 not fitting rather than the very largest; it is
    deterministic, which is what the resume needs."""
    sizes = np.asarray(sizes, dtype=np.int64)
    lo = min(rows, len(sizes))  # one sample per row always fits
    hi = int(np.searchsorted(np.cumsum(sizes), rows * capacity, side="right"))
    best = first_fit_decreasing(sizes[:lo], capacity)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        placed = first_fit_decreasing(sizes[:mid], capacity)
        if len(placed) <= rows:
            lo, best = mid, placed
        else:
            hi = mid - 1
    empty = np.empty(0, dtype=np.int64)
    return lo, best + [empty] * (rows - len(best))

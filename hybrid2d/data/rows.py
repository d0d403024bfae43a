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
    the first row with room for it.

    Items of one size are placed together, which is what FFD does one by one: the first row with
    room takes as many as fit, then the next, and the rest open rows of capacity // size each. So
    the work is one numpy pass over the rows per distinct size, not a Python step per item."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if len(sizes) and (sizes.max() > capacity or sizes.min() < 1):
        got = f"{sizes.min()}..{sizes.max()}"
        raise ValueError(f"item sizes must lie in [1, {capacity}], got {got}")
    if not len(sizes):
        return []
    order = np.argsort(-sizes, kind="stable")
    ordered = sizes[order]
    room = np.empty(len(sizes), dtype=np.int64)  # free positions of each open row
    row_of = np.empty(len(sizes), dtype=np.int64)  # the row of each item, in `order`'s order
    opened = 0
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    for a, b in zip(starts, [*starts[1:], len(sizes)], strict=True):
        size = int(ordered[a])
        fit = np.cumsum(room[:opened] // size)  # items the open rows take, counted in row order
        placed = min(b - a, int(fit[-1]) if opened else 0)
        if placed:
            rows = np.searchsorted(fit, np.arange(placed), side="right")
            row_of[a : a + placed] = rows
            room[:opened] -= np.bincount(rows, minlength=opened) * size
        rest = b - a - placed
        if rest:
            rows = np.arange(rest) // (capacity // size)
            row_of[a + placed : b] = opened + rows
            room[opened : opened + rows[-1] + 1] = capacity - np.bincount(rows) * size
            opened += int(rows[-1]) + 1
    grouped = np.argsort(row_of, kind="stable")  # by row, each in placement order
    counts = np.bincount(row_of, minlength=opened)
    return np.split(order[grouped], np.cumsum(counts)[:-1])


def fill_rows(sizes: np.ndarray, capacity: int, rows: int) -> tuple[int, list[np.ndarray]]:
    """(k, the rows) for the longest prefix sizes[:k] that FFD places into `rows` rows (rows left
    empty are returned empty). `sizes` must hold at least `rows` items and more positions than
    rows x capacity, or all of the stream there is.

    Binary search on k: FFD is not monotone in general (one more item can, rarely, save a row), so
    this finds a k that fits with k + 1 not fitting rather than the very largest; it is
    deterministic, which is what the resume needs."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = np.cumsum(sizes)
    lo = min(rows, len(sizes))  # one sample per row always fits
    hi = int(np.searchsorted(total, rows * capacity, side="right"))
    best = first_fit_decreasing(sizes[:lo], capacity)
    # FFD fills rows of many small samples (chat data) to the last position or two: try every
    # position filled, then the prefix 1% short of full, before searching the range between.
    guess = int(np.searchsorted(total, 0.99 * rows * capacity, side="right"))
    for k in (hi, guess):
        if lo < k <= hi:
            placed = first_fit_decreasing(sizes[:k], capacity)
            if len(placed) <= rows:
                lo, best = k, placed
                break
            hi = k - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        placed = first_fit_decreasing(sizes[:mid], capacity)
        if len(placed) <= rows:
            lo, best = mid, placed
        else:
            hi = mid - 1
    empty = np.empty(0, dtype=np.int64)
    return lo, best + [empty] * (rows - len(best))

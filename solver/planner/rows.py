"""The searches of `runs.py` on many rows at once: one array pass over every layout
of a kind (or of a group) instead of a numpy call per layout. The bounds price each
layout at a dozen microbatch sizes and meet it in hundreds of groups, so the calls'
own cost, not their arithmetic, was what a bound paid. Pure functions of arrays;
each gives, row by row, the figures its one-row counterpart in `runs.py` gives, bit
for bit (a minimum or a count: no sum is reordered)."""

from __future__ import annotations

import numpy as np


def nondecreasing_rows(rows: np.ndarray) -> np.ndarray:
    """`runs.nondecreasing` of each row of `rows` (layouts x run lengths)."""
    return np.minimum.accumulate(rows[:, ::-1], axis=1)[:, ::-1]


def counts_within(rows: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """[row, t]: how many entries of the row are at most `limits[t]`, which is
    `np.searchsorted(row, limits, side="right")` for a nondecreasing row; `limits`
    ascending, no NaN anywhere. One search of every entry into the limits, then a
    count per position: an entry no greater than limits[t] is within every later one."""
    size = len(limits)
    at = np.searchsorted(limits, rows, side="left")  # the first limit each entry is within
    flat = (at + (size + 1) * np.arange(len(rows))[:, None]).ravel()
    per = np.bincount(flat, minlength=len(rows) * (size + 1)).reshape(len(rows), size + 1)
    return np.cumsum(per[:, :size], axis=1)


def most_within(runs: np.ndarray, limits: np.ndarray, tol: float) -> np.ndarray:
    """`runs.longest` of each row of `runs` on the same limits (ascending)."""
    return counts_within(nondecreasing_rows(runs), limits * tol)


def least_for_counts(counts: np.ndarray, least: np.ndarray, layers: int) -> np.ndarray:
    """Per count r of layers (1..layers), the least over rows of row[ceil(r / s) - 1],
    `s` = the row's `counts` (stages): the least time at which some layout's stages
    have room for r layers, when `least[row, q - 1]` is the least at which one of its
    stages has room for q."""
    s = counts.astype(int)[:, None]
    r = np.arange(1, layers + 1)[None, :]
    return np.take_along_axis(least, (r + s - 1) // s - 1, axis=1).min(axis=0)


def least_layer_bytes(state: np.ndarray, saved: np.ndarray, inputs: np.ndarray, recomputed: np.ndarray,
                      shard: np.ndarray, held: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per stage (a row of `state`, the bytes each layer's state takes on one of its
    devices; `shard` its examples per device over its model axis), the least bytes
    any one layer needs with `held` microbatches' activations kept, the least input
    of any layer (what full recomputation keeps per microbatch), and the least a
    recomputing layer needs: `PerLayer`'s `state + saved * held`, `inputs` and
    `state + recomputed`, `saved`, `inputs` and `recomputed` scaled by the shard as
    `StageCosts.per_layer` scales them."""
    shard = shard[:, None]
    return ((state + (saved * shard) * held).min(axis=1), (inputs * shard).min(axis=1),
            (state + recomputed * shard).min(axis=1))

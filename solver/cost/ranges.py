"""Figures per layer range, as the stage tables hold them: an (n + 1) x (n + 1) array
whose [i, j] is the figure of layers i..j-1 on one stage (the lower triangle unused).
Prefix sums make every range's sum one subtraction, so a table prices all O(n^2)
ranges at once instead of summing each."""

from __future__ import annotations

import numpy as np


def span(prefix: np.ndarray) -> np.ndarray:
    """[i, j] = prefix[j] - prefix[i]; the lower triangle is never used."""
    return prefix[None, :] - prefix[:, None]


def range_max(values: np.ndarray) -> np.ndarray:
    n = len(values)
    out = np.zeros((n + 1, n + 1))
    for i in range(n):
        out[i, i + 1 :] = np.maximum.accumulate(values[i:])
    return out


def first(values: np.ndarray) -> np.ndarray:
    """[i, j] = values[i]: a range's first layer's figure."""
    return np.concatenate([values, [0.0]])[:, None]


def last(values: np.ndarray) -> np.ndarray:
    """[i, j] = values[j - 1]: a range's last layer's figure."""
    return np.concatenate([[0.0], values])[None, :]


def full(values: np.ndarray | float, shape: tuple[int, ...]) -> np.ndarray:
    """`values` as an array of `shape` (a read-only view where it must broadcast); an
    array already of that shape as it is (tables are built by the thousand)."""
    if isinstance(values, np.ndarray) and values.shape == shape:
        return values
    return np.broadcast_to(values, shape)


def cumsum(values: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(values)])


def at(values: np.ndarray | float, shape: tuple[int, ...], i: int, j: int) -> float:
    """Entry [i, j] of `values` as an array of `shape` (`full`'s), without building the
    broadcast view where it already is one (an estimate reads a dozen figures a stage)."""
    if isinstance(values, np.ndarray) and values.shape == shape:
        return float(values[i, j])
    if isinstance(values, (float, int)):
        return float(values)
    return float(np.broadcast_to(values, shape)[i, j])

"""Where a set's order is not known its bound still knows that one stage is first and
another last (`bottleneck._unplaced`): the summed bases are the least over every such
pair, the others middle (brute force on random figures), and a language model's head,
dearest at the last place, is priced on some stage (two stages at the cheaper of either
end each, as before, left it out)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from solver.planner.bottleneck import _unplaced


def _figures(first: np.ndarray, middle: np.ndarray, last: np.ndarray) -> np.ndarray:
    """`LayoutRows.by_place` with these bases (plain and recomputing alike), a layout per stage."""
    figures = np.zeros((6, 3, len(first)))
    for place, values in enumerate((first, middle, last)):
        figures[4, place] = figures[5, place] = values
    return figures


def _least(first, middle, last) -> float:  # noqa: ANN001
    """The least summed base over every choice of a first and another last stage."""
    k = len(first)
    if k == 1:
        return float(last[0])
    return min(sum(first[s] if s == i else last[s] if s == j else middle[s] for s in range(k))
               for i, j in itertools.permutations(range(k), 2))


def test_the_bases_are_the_least_over_every_first_and_last():
    rng = np.random.default_rng(3)
    for _ in range(300):
        k = int(rng.integers(1, 7))
        first, middle, last = (rng.uniform(0.1, 2.0, k).round(2) for _ in range(3))
        at = np.arange(k)[None, :]
        ones = np.ones((1, k), dtype=int)
        total, _ = _unplaced(_figures(first, middle, last), at, ones.astype(bool), ones, ones)
        assert float(total[0]) == pytest.approx(_least(first, middle, last), rel=1e-12), (first, middle, last)


def test_the_head_is_priced_on_some_stage():
    first, middle, last = np.full(4, 1.0), np.full(4, 2.0), np.full(4, 10.0)  # a head five blocks dear
    at, ones = np.arange(4)[None, :], np.ones((1, 4), dtype=int)
    total, _ = _unplaced(_figures(first, middle, last), at, ones.astype(bool), ones, ones)
    assert float(total[0]) == 1.0 + 2.0 + 2.0 + 10.0

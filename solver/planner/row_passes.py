"""How the bounds group rows of stages into array passes (`bounds.LowerBounds._bounds`):
each group of one stage count is prepared apart (its tails, sends and orders' rows),
then the groups are priced together, rows of fewer stages padded at the front
(`bottleneck.least_steps`' `counts`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from solver.planner.layouts import KindLayout


class Rows(NamedTuple):
    """Rows of stages a bound prices in one pass: where each row's figure goes, each
    stage's fits ([row, stage, plain or recomputing]) and layout in the table, each
    row's offset (its tail's bound and sends) and least sends both ways; `counts`: each
    row's own stages, where rows are padded (`merged`)."""

    positions: np.ndarray
    fitting: np.ndarray
    at: np.ndarray
    offsets: np.ndarray
    sends: np.ndarray
    counts: np.ndarray | None = None


def merged(groups: list[Rows]) -> list[Rows]:
    """Groups of rows, each of one stage count, as one group padded at the front to the
    most stages (a padding stage's layout its row's first, its fits none), but rows of
    one stage apart (a lone stage is the last, not a padded pair's first or last): a
    pass costs a few hundred microseconds whatever its rows, and a pass per stage count
    made 165 passes of a solve on 64 GPUs of three kinds, where these make 79."""
    lone = [g for g in groups if g.at.shape[1] == 1]
    rest = [g for g in groups if g.at.shape[1] > 1]
    if len(rest) < 2:
        return lone + rest
    width = max(g.at.shape[1] for g in rest)

    def padded(g: Rows) -> Rows:
        extra = width - g.at.shape[1]
        return g._replace(fitting=np.concatenate([np.zeros((len(g.at), extra, 2), g.fitting.dtype), g.fitting], axis=1),
                          at=np.concatenate([np.repeat(g.at[:, :1], extra, axis=1), g.at], axis=1),
                          counts=np.full(len(g.at), g.at.shape[1]))

    return lone + [Rows(*(np.concatenate(field) for field in zip(*map(padded, rest))))]


def by_stages(sets: list[tuple[KindLayout, ...]]) -> dict[int, list[int]]:
    """The sets' positions by their stage count: each count's rows are prepared apart
    (their orders' rows, tails and sends have as many stages) before `merged` joins them."""
    out: dict[int, list[int]] = {}
    for i, layouts in enumerate(sets):
        out.setdefault(sum(lay.stages for lay in layouts), []).append(i)
    return out

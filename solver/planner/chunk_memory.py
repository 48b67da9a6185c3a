"""Whether an interleaved row's chunks fit their device groups' memory: the v chunks a
group holds share its devices, so their bytes add up (each chunk alone always fits,
its table having checked it). The search refuses a row before its split where no
split could fit (`chunks_may_fit`) and a split that does not (`chunks_fit`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from solver.cost.stage_costs import INF
from solver.cost.stage_tables import StageTable
from solver.planner.rows import least_runs_rows


def chunks_fit(tables: Sequence[StageTable], cuts: tuple[int, ...], groups: int) -> bool:
    """Chunks of one device group share its memory: their sum must fit (one chunk
    per group always does, the tables having checked it)."""
    if len(tables) == groups:
        return True
    bounds = list(zip([0, *cuts], [*cuts, tables[0].forward.shape[0] - 1]))
    used = [0.0] * groups
    for p, (t, (i, j)) in enumerate(zip(tables, bounds)):
        used[p % groups] += float(t.memory[i, j])
    return all(u <= tables[g].capacity for g, u in enumerate(used))


def chunks_may_fit(tables: Sequence[StageTable], groups: int) -> bool:
    """Whether some split's chunks could share their device groups' memory. A chunk
    holds a run of one layer or more, whose bytes are at least the least of any run of
    that length at its place (the first chunk's runs start at the first layer, the
    last's end at the last: a language model's embedding and head, whose state a first
    group's two chunks may not fit). Per group, the least bytes its chunks take for each
    count of layers they hold together (a min-plus sum over its chunks, in `chunks_fit`'s
    order, so a split it accepts never fails this); the layers fit only if the most
    each group holds within its capacity add up to every layer. (The least bytes per
    chunk alone, summed per group, let through rows whose groups each fit some split
    but not the same one: on 64 GPUs of three kinds, six rows of 16 GB T4s or V100s alone
    (the bound's own searches), two to four groups of two or four chunks, each refused
    only after its sweep.)"""
    n = tables[0].memory.shape[0] - 1
    held = np.stack([np.where(np.isfinite(t.forward), t.memory, INF) for t in tables])  # [chunk, i, j]: bytes per range
    by_length = np.full((len(tables), n + 1), INF)  # [chunk, l]: the least bytes of a run of l layers at its place
    by_length[:, 1:] = least_runs_rows(held)
    by_length[0, 1:] = held[0, 0, 1:]
    by_length[-1, 1:] = held[-1, n - np.arange(1, n + 1), n]
    least = np.full((groups, n + 1), INF)  # [group, L]: the least bytes of its chunks so far holding L layers
    least[:, 0] = 0.0
    skewed = np.full((groups, n + 1, 2 * n + 2), INF)  # row i shifted right by i when read at width 2n + 1
    for first in range(0, len(tables), groups):
        skewed[:, :, : n + 1] = least[:, :, None] + by_length[first : first + groups, None, :]
        shifted = skewed.reshape(groups, -1)[:, : (n + 1) * (2 * n + 1)].reshape(groups, n + 1, 2 * n + 1)
        least = shifted[:, :, : n + 1].min(axis=1)
    capacity = np.array([t.capacity for t in tables[:groups]], dtype=float)[:, None]
    within = least <= capacity
    if not within.any(axis=1).all():
        return False
    return int((n - np.argmax(within[:, ::-1], axis=1)).sum()) >= n

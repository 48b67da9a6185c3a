"""Whether an interleaved row's chunks fit their device groups' memory: the v chunks a
group holds share its devices, so their bytes add up (each chunk alone always fits,
its table having checked it). The search refuses a row before its split where no
split could fit (`chunks_may_fit`) and a split that does not (`chunks_fit`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from solver.cost.stage_tables import StageTable


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
    """Whether some split's chunks could share their device groups' memory: each
    chunk takes at least the least memory of any range its table runs (the first
    chunk's ranges start at the first layer, the last's end at the last: a language
    model's embedding and head, whose state a first group's two chunks may not fit),
    summed per group in `chunks_fit`'s order (so a split it accepts never fails
    this). Most groups of four chunks that a split cannot fit fail here, before the
    split's sweep."""
    used = [0.0] * groups
    last = len(tables) - 1
    for p, t in enumerate(tables):
        held = t.memory[0] if p == 0 else t.memory[:, -1] if p == last else t.memory
        runs = np.isfinite(t.forward[0] if p == 0 else t.forward[:, -1] if p == last else t.forward)
        if not runs.any():
            return False
        used[p % groups] += float(held[runs].min())
    return all(u <= tables[g].capacity for g, u in enumerate(used))

"""Contiguous partitions of a sequence: the dynamic programs behind layer
construction and the first stage assignment. Pure numpy; no JAX here."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def min_max_cuts(
    item_costs: Sequence[float],
    candidates: Sequence[int],
    num_parts: int,
    cut_costs: Sequence[float] | None = None,
    part_speeds: Sequence[float] | None = None,
    tolerance: float = 1e-6,
) -> list[int]:
    """Splits items 0..n-1 into `num_parts` contiguous, non-empty parts, cutting only
    at `candidates` (a cut at position c starts a part at item c).

    Minimises the largest part time (cost / the part's speed, parts in order), then,
    among splits within `tolerance` of that, the summed `cut_costs` of the cuts used.
    Returns the sorted cut positions (num_parts - 1 of them).
    """
    costs = np.asarray(item_costs, dtype=float)
    n = len(costs)
    if num_parts < 1 or num_parts > n:
        raise ValueError(f"cannot split {n} items into {num_parts} parts")
    cands = sorted({int(c) for c in candidates if 0 < c < n})
    if len(cands) < num_parts - 1:
        raise ValueError(f"only {len(cands)} cut points for {num_parts} parts")
    speeds = np.ones(num_parts) if part_speeds is None else np.asarray(part_speeds, dtype=float)
    cut_cost = dict(zip(cands, [0.0] * len(cands))) if cut_costs is None else {c: float(cut_costs[c]) for c in cands}

    points = np.array([0] + cands + [n])  # part boundaries allowed
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    bound = _min_max(points, prefix, num_parts, speeds)
    limit = bound * (1 + tolerance) + 1e-12
    return _min_cut_cost_within(points, prefix, num_parts, speeds, limit, cut_cost)


def _min_max(points: np.ndarray, prefix: np.ndarray, k: int, speeds: np.ndarray) -> float:
    m = len(points)
    best = np.full(m, np.inf)  # best[j]: parts so far end at points[j]
    best[0] = 0.0
    for part in range(k):
        new = np.full(m, np.inf)
        for j in range(1, m):
            span = (prefix[points[j]] - prefix[points[:j]]) / speeds[part]
            new[j] = np.min(np.maximum(best[:j], span))
        best = new
    return float(best[m - 1])


def _min_cut_cost_within(points, prefix, k, speeds, limit, cut_cost) -> list[int]:
    m = len(points)
    total = np.full((k + 1, m), np.inf)
    back = np.zeros((k + 1, m), dtype=int)
    total[0, 0] = 0.0
    penalty = np.array([cut_cost.get(int(p), 0.0) for p in points])
    for part in range(1, k + 1):
        for j in range(1, m):
            span = (prefix[points[j]] - prefix[points[:j]]) / speeds[part - 1]
            cand = np.where(span <= limit, total[part - 1, :j] + (penalty[:j] if part > 1 else 0.0), np.inf)
            i = int(np.argmin(cand))
            total[part, j], back[part, j] = cand[i], i
    if not np.isfinite(total[k, m - 1]):
        raise ValueError("no split within the balance limit")  # unreachable: limit >= optimum
    cuts, j = [], m - 1
    for part in range(k, 0, -1):
        j = back[part, j]
        cuts.append(int(points[j]))
    return sorted(cuts[:-1])

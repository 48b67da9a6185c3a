"""Exact minimum of a sum of unary and pairwise costs by variable elimination.

A stage's sharding problem without a binding memory budget is such a sum: each
operator's own cost per strategy, and a resharding cost per pair of neighbours. Once
identical layers are tied and dead ends removed, a transformer stage has a few dozen
free operators joined in a near-chain, so eliminating them one at a time (min-sum
dynamic programming on the interaction graph, cheapest elimination first) never
builds a table of more than a few thousand entries and finds the optimum in
a fraction of a second, where CP-SAT needed seconds to prove the same optimum (a
Llama-2-7B stage of 11 blocks: 0.3 s against 1.5 to 5 s). Graphs whose elimination
would build larger tables than the caller allows are left to it (CP-SAT).

Ties go to the lowest strategy index at each elimination, so the answer is the same
on every run and in every process.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

MAX_TABLE = 1 << 24  # entries of the largest table elimination may build (float64: 128 MiB)


def elimination_order(size: list[int], edges: set[tuple[int, int]], max_work: int,
                      max_entries: int = MAX_TABLE) -> list[int] | None:
    """The order to eliminate nodes in (each time the one whose table, over it and its
    neighbours, is smallest), worked out on the graph alone; None when one table
    would pass `max_entries` or all of them together `max_work`."""
    near: list[set[int]] = [set() for _ in size]
    for a, b in edges:
        near[a].add(b)
        near[b].add(a)
    remaining, order, work = set(range(len(size))), [], 0
    while remaining:
        x = min(remaining, key=lambda v: (math.prod(size[w] for w in near[v]) * size[v], v))
        entries = math.prod(size[w] for w in near[x]) * size[x]
        work += entries
        if entries > max_entries or work > max_work:
            return None
        for a in near[x]:
            near[a] |= near[x] - {a}
            near[a].discard(x)
        remaining.discard(x)
        order.append(x)
    return order


def min_sum(unary: list[np.ndarray], pairs: dict[tuple[int, int], np.ndarray],
            max_work: int = 1 << 26) -> tuple[list[int], float] | None:
    """The choice per node minimising sum(unary[k][choice[k]]) + sum(pairs[(a, b)][choice[a], choice[b]])
    (pairs keyed a < b, rows a's choices), and that minimum; None when eliminating
    would build tables of more than `max_work` entries in all (`elimination_order`)."""
    size = [len(u) for u in unary]
    factors: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    touching: list[set[int]] = [set() for _ in unary]
    keys = itertools.count()

    def add(variables: tuple[int, ...], table: np.ndarray) -> None:
        key = next(keys)
        factors[key] = (variables, table)
        for v in variables:
            touching[v].add(key)

    eliminated: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    constant = 0.0
    for k, u in enumerate(unary):
        add((k,), np.asarray(u, dtype=float))
    for (a, b), mat in pairs.items():
        add((a, b), np.asarray(mat, dtype=float))
    order = elimination_order(size, set(pairs), max_work)
    if order is None:
        return None
    for x in order:
        scope = tuple(sorted({v for f in touching[x] for v in factors[f][0]}))
        total = np.zeros([size[v] for v in scope])
        for f in list(touching[x]):
            variables, table = factors.pop(f)
            total = total + table.reshape([size[v] if v in variables else 1 for v in scope])
            for v in variables:
                touching[v].discard(f)
        axis = scope.index(x)
        best = total.argmin(axis=axis)
        rest = scope[:axis] + scope[axis + 1 :]
        eliminated.append((x, rest, best))
        least = np.take_along_axis(total, np.expand_dims(best, axis), axis).squeeze(axis)
        if rest:
            add(rest, least)
        else:
            constant += float(least)
    choice = [0] * len(unary)
    for x, rest, best in reversed(eliminated):
        choice[x] = int(best[tuple(choice[v] for v in rest)])
    return choice, constant

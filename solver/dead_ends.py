"""Dead-end elimination: strategies no optimal sharding needs, removed before the ILP.

A sharding problem is a sum of unary costs (an operator's own time under each
strategy) and pairwise costs (resharding between neighbours). Strategy i of a node
is a dead end when some other strategy j of the same node is at least as cheap
whatever its neighbours pick (Goldstein's criterion, from protein design):

    unary[i] - unary[j] + sum over neighbours n of  min over s of (pair_n[i, s] - pair_n[j, s])  >= 0

Swapping i for j in any solution then never costs more, so some optimal solution
avoids i. Where memory is constrained, j must also hold no more bytes than i at
every program point. Removing a neighbour's dead ends can only raise the minimum,
so the test repeats until nothing changes. On a transformer stage most of a
matmul's twenty-odd layouts fall (the ones that split a dimension the neighbours
then have to gather), and CP-SAT proves the rest optimal in a fraction of the time.

Sound, not heuristic: the optimum of the reduced problem is an optimum of the
original one (ties keep the lower-numbered strategy).
"""

from __future__ import annotations

import numpy as np


def alive_strategies(unary: list[np.ndarray], pairs: dict[tuple[int, int], np.ndarray],
                     memory: list[np.ndarray] | None = None, max_rounds: int = 20) -> list[np.ndarray]:
    """Per node, the indices of its strategies that survive elimination (sorted).

    `pairs[(a, b)]` is the cost matrix of nodes a < b (rows a's strategies);
    `memory[k]` (programs points x strategies of node k), when given, is the bytes
    node k's strategies hold at each constrained program point."""
    incident: list[list[tuple[int, np.ndarray]]] = [[] for _ in unary]
    for (a, b), mat in pairs.items():
        incident[a].append((b, mat))
        incident[b].append((a, mat.T))
    alive = [np.ones(len(u), dtype=bool) for u in unary]
    for _ in range(max_rounds):
        changed = False
        for k, u in enumerate(unary):
            idx = np.flatnonzero(alive[k])
            if len(idx) <= 1:
                continue
            # margin[i, j]: how much worse i is than j in the context least favourable to j.
            margin = u[idx][:, None] - u[idx][None, :]
            for other, mat in incident[k]:
                sub = mat[np.ix_(idx, np.flatnonzero(alive[other]))]
                margin = margin + (sub[:, None, :] - sub[None, :, :]).min(axis=2)
            holds_less = np.ones_like(margin, dtype=bool)
            if memory is not None and memory[k].size:
                m = memory[k][:, idx]
                holds_less = (m[:, None, :] <= m[:, :, None]).all(axis=0)  # [i, j]: j holds <= i everywhere
            dominated = (margin >= 0) & holds_less
            np.fill_diagonal(dominated, False)
            keep = np.ones(len(idx), dtype=bool)
            for i in reversed(range(len(idx))):  # one at a time, so of two equal strategies the first stays
                if (dominated[i] & keep).any():
                    keep[i] = False
            if not keep.all():
                alive[k][idx[~keep]] = False
                changed = True
        if not changed:
            break
    return [np.flatnonzero(a) for a in alive]

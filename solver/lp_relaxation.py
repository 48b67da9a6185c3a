"""The sharding problem's linear relaxation, which often proves the integer optimum.

A stage's sharding problem, once identical blocks are tied, is a sum of unary and
pairwise costs over a few dozen operators. Its usual integer program (each operator's
strategy a 0/1 vector summing to one; each pair of neighbours a 0/1 table whose rows
and columns sum to the two vectors) relaxed to real numbers in [0, 1] is the "local
polytope" LP. Where the interaction graph is close to a tree its optimum is often a
vertex with every operator's vector 0/1; then that choice costs what the relaxation
does, and the relaxation is a lower bound on every choice: the choice is optimal.

Why it is here: on the stages where elimination would build tables too large
(tied blocks on a 3-axis mesh, up to 115 choices per operator), CP-SAT spends
most of its time on this same relaxation at its root: 6.7-8.7 s for each of
Llama-2-13B's stages on a 32x2x2 mesh (`benchmarks/real_models.py`), where HiGHS's
dual simplex solves it in 0.3-0.6 s and finds it integral. Where the optimum is
fractional (a binding memory budget makes it so), or HiGHS does not finish, the
caller goes on to CP-SAT, starting from the relaxation's heaviest strategies; the
relaxation's value, a lower bound on every choice, still refuses a mesh that cannot
beat the cheapest one so far (`solve_intra_op`'s `beat`). HiGHS (through scipy) runs
the same pivots on the same input, so every process gets the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sparse
from scipy.optimize import linprog

_INTEGRAL_TOL = 1e-6  # a strategy's weight this close to 0 or 1 counts as that


@dataclass(frozen=True)
class Relaxation:
    """The relaxation's optimum: per node, the weight it gives each strategy, and its
    value, a lower bound on every choice's cost (HiGHS's, to its tolerances)."""

    weights: list[np.ndarray]
    value: float

    def integral_choice(self) -> list[int] | None:
        """The strategy per node where the optimum puts all of every node's weight on
        one strategy: then the optimum of the integer problem too. None where some
        node's weight is split."""
        if any(np.abs(w - np.round(w)).max(initial=0.0) > _INTEGRAL_TOL for w in self.weights):
            return None
        return self.heaviest()

    def heaviest(self) -> list[int]:
        """Each node's strategy of the largest weight: a good start for a search where
        the optimum is fractional."""
        return [int(np.argmax(w)) for w in self.weights]


def relaxed(unary: list[np.ndarray], pairs: dict[tuple[int, int], np.ndarray],
            rows: list[dict[int, np.ndarray]] | None = None, limit: int | None = None,
            time_limit_s: float = 60.0) -> Relaxation | None:
    """The relaxation's optimum for the sum sum(unary[k][x_k]) + sum(pairs[(a, b)][x_a,
    x_b]) with every memory row's bytes, sum(rows[r][j][x_j]), within `limit`; None
    where it is infeasible or not found within `time_limit_s` of wall time. Rows whose
    largest total cannot pass `limit` are left out, as they bind nothing."""
    if not unary:
        return Relaxation([], 0.0)
    sizes = np.array([len(u) for u in unary])
    start = np.concatenate([[0], np.cumsum(sizes)])
    nx = int(start[-1])
    cost = [np.concatenate(unary)]
    # Each node's strategies sum to one.
    r_idx = [np.repeat(np.arange(len(unary)), sizes)]
    c_idx = [np.arange(nx)]
    vals = [np.ones(nx)]
    n_rows, n_vars = len(unary), nx
    for (a, b), mat in pairs.items():
        p, q = mat.shape
        table = n_vars + np.arange(p * q).reshape(p, q)
        # Row i of the table sums to a's weight on strategy i; column j to b's on j.
        r_idx += [n_rows + np.repeat(np.arange(p), q), n_rows + np.arange(p),
                  n_rows + p + np.tile(np.arange(q), p), n_rows + p + np.arange(q)]
        c_idx += [table.ravel(), start[a] + np.arange(p), table.ravel(), start[b] + np.arange(q)]
        vals += [np.ones(p * q), -np.ones(p), np.ones(p * q), -np.ones(q)]
        cost.append(mat.ravel())
        n_rows += p + q
        n_vars += p * q
    equal = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(r_idx), np.concatenate(c_idx))), shape=(n_rows, n_vars))
    rhs = np.zeros(n_rows)
    rhs[: len(unary)] = 1.0
    upper = upper_rhs = None
    binding = [row for row in rows or [] if limit is not None and sum(int(m.max()) for m in row.values()) > limit]
    if binding:
        ur, uc, uv = [], [], []
        for r, row in enumerate(binding):
            for j, m in row.items():
                ur.append(np.full(len(m), r))
                uc.append(start[j] + np.arange(len(m)))
                uv.append(np.asarray(m, dtype=float))
        upper = sparse.csr_matrix((np.concatenate(uv), (np.concatenate(ur), np.concatenate(uc))), shape=(len(binding), n_vars))
        upper_rhs = np.full(len(binding), float(limit))
    found = linprog(np.concatenate(cost), A_ub=upper, b_ub=upper_rhs, A_eq=equal, b_eq=rhs, bounds=(0.0, 1.0),
                    method="highs-ds", options={"time_limit": time_limit_s})
    if found.status != 0:
        return None
    return Relaxation([found.x[start[k] : start[k + 1]] for k in range(len(unary))], float(found.fun))

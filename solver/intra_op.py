"""Intra-operator sharding as an integer program: the solver half of our Alpa-style pass.

Alpa picks, for every operator, one of several sharding strategies so that compute,
the collectives each strategy implies, and the resharding between operators whose
strategies disagree add up to the least time while every program point still fits in
device memory. Today's JAX has no such pass we can call, so we run it ourselves at the
jaxpr level: the JAX half turns a jaxpr into `Node`s and `Edge`s with measured or
modelled costs; this module only solves the resulting problem. It is pure Python,
numpy, OR-Tools CP-SAT and (for the linear relaxation, solver/lp_relaxation.py)
HiGHS through scipy, and must never import jax (the `solver/` package is jax-free
so it can be tested and reused without a device runtime).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from ortools.sat.python import cp_model

from solver.cpsat import cp_solver
from solver.dead_ends import alive_strategies
from solver.elimination import min_sum
from solver.lp_relaxation import relaxed

log = logging.getLogger(__name__)

# CP-SAT needs integer costs: the largest single cost term becomes about this many
# units, so rounding moves each term by at most 1e-9 of the largest term.
_SCALE_TARGET = 1e9
# ...but the whole objective must stay far inside int64, whatever the problem size.
_TOTAL_CAP = 1e15
# Table entries exact elimination may build per second of the time limit: about a
# quarter of what numpy sums and minimises in that time on one core.
_ELIMINATED_PER_S = 10_000_000
# A relaxation's value refuses `beat` only above it by more than HiGHS's tolerances
# (its optimum is exact to about 1e-7 of the objective's terms).
_BOUND_MARGIN = 1 + 1e-6


class IntraOpError(ValueError):
    """A sharding problem that is malformed, or that no choice of strategies can meet."""


@dataclass(frozen=True)
class Strategy:
    """One way to shard one operator, with the per-device costs it implies."""

    name: str  # e.g. "S0R x RS1 -> S0S1"
    compute_s: float  # per-device compute time with this strategy
    comm_s: float  # collective this strategy implies (e.g. all-reduce of partial sums)
    memory_bytes: int  # per-device bytes of the output (and kept operands)


@dataclass(frozen=True)
class Node:
    """An operator and the strategies it may use (at least one)."""

    name: str
    strategies: tuple[Strategy, ...]


@dataclass(frozen=True)
class Edge:
    """A value flowing src -> dst; cost_s[i][j] is the resharding time when src uses
    strategy i and dst uses strategy j (zero on the diagonal-like agreeing pairs)."""

    src: int
    dst: int
    cost_s: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class IntraOpProblem:
    """The whole program: operators, data edges, and the memory budget per device.

    `live_sets[k]` lists the nodes whose outputs are alive together at program point k;
    with `memory_limit_bytes` set, each such set must fit in the budget.

    `same_as[k]` is the node whose strategy node k must copy (k itself when free; empty
    means all free). Identical layers tie their operators this way, as Alpa does: the
    solver then has one layer's variables to search however many layers the stage has,
    and the answer is optimal among the plans where identical layers agree."""

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...] = ()
    memory_limit_bytes: int | None = None
    live_sets: tuple[tuple[int, ...], ...] = ()
    same_as: tuple[int, ...] = ()

    def leaders(self) -> list[int]:
        """Node -> the node it copies (itself when free)."""
        return list(self.same_as) if self.same_as else list(range(len(self.nodes)))


@dataclass(frozen=True)
class IntraOpSolution:
    """The chosen strategy per node, its exact float cost, and how sure the solver is."""

    choice: tuple[int, ...]  # strategy index per node
    cost_s: float  # objective, recomputed exactly in floats from the choice
    bound_s: float  # best lower bound the solver proved
    optimal: bool
    gap: float  # (cost - bound) / cost, 0 when optimal
    solve_s: float

    def strategy_names(self, problem: IntraOpProblem) -> tuple[str, ...]:
        """Names of the chosen strategies, for logs and plan files."""
        return tuple(n.strategies[c].name for n, c in zip(problem.nodes, self.choice))

    def names(self, problem: IntraOpProblem) -> list[str]:
        """The same names as a list (the form the tests and plan printers compare against)."""
        return list(self.strategy_names(problem))


def _check_cost(value: float, what: str) -> None:
    if not math.isfinite(value) or value < 0:
        raise IntraOpError(f"{what} is {value!r}; costs must be finite and >= 0 (fix the cost model)")


def _validate(problem: IntraOpProblem) -> None:
    """Rejects malformed problems up front, with the offending node or edge named."""
    n = len(problem.nodes)
    seen: set[int] = set()  # identical blocks share their strategy tuples and edge tables: check each once
    for k, node in enumerate(problem.nodes):
        if not node.strategies:
            raise IntraOpError(f"node {k} ({node.name!r}) has no sharding strategy; give it at least one (e.g. replicated)")
        if id(node.strategies) in seen:
            continue
        seen.add(id(node.strategies))
        for s in node.strategies:
            _check_cost(s.compute_s, f"compute_s of node {k} ({node.name!r}) strategy {s.name!r}")
            _check_cost(s.comm_s, f"comm_s of node {k} ({node.name!r}) strategy {s.name!r}")
            _check_cost(s.memory_bytes, f"memory_bytes of node {k} ({node.name!r}) strategy {s.name!r}")
    for e_idx, e in enumerate(problem.edges):
        if not (0 <= e.src < n and 0 <= e.dst < n):
            raise IntraOpError(f"edge {e_idx} ({e.src} -> {e.dst}) references a node that does not exist; there are {n} nodes (0..{n - 1})")
        want = (len(problem.nodes[e.src].strategies), len(problem.nodes[e.dst].strategies))
        if len(e.cost_s) != want[0] or any(len(row) != want[1] for row in e.cost_s):
            got = f"{len(e.cost_s)} rows of lengths {sorted({len(row) for row in e.cost_s})}"
            raise IntraOpError(f"edge {e_idx} ({e.src} -> {e.dst}) cost matrix has {got} but needs {want} "
                               f"(src x dst strategy counts); give one row per src strategy, one column per dst strategy")
        if id(e.cost_s) in seen:
            continue
        seen.add(id(e.cost_s))
        costs = np.asarray(e.cost_s, dtype=float)
        if costs.size and not (np.isfinite(costs).all() and (costs >= 0).all()):
            bad = costs[~(np.isfinite(costs) & (costs >= 0))][0]
            _check_cost(float(bad), f"resharding cost on edge {e_idx} ({e.src} -> {e.dst})")
    if problem.same_as:
        if len(problem.same_as) != n:
            raise IntraOpError(f"same_as has {len(problem.same_as)} entries for {n} nodes; give one per node")
        for k, r in enumerate(problem.same_as):
            if not 0 <= r < n or problem.same_as[r] != r:
                raise IntraOpError(f"node {k} copies node {r}, which is not a free node; point every tied node at one "
                                   f"that copies itself")
            if len(problem.nodes[r].strategies) != len(problem.nodes[k].strategies):
                raise IntraOpError(f"node {k} ({problem.nodes[k].name!r}) is tied to node {r} ({problem.nodes[r].name!r}) "
                                   f"but they have {len(problem.nodes[k].strategies)} and {len(problem.nodes[r].strategies)} "
                                   f"strategies; only tie operators with the same strategies")
    for k, live in enumerate(problem.live_sets):
        for v in live:
            if not 0 <= v < n:
                raise IntraOpError(f"live set {k} references missing node {v}; there are {n} nodes")
    if problem.memory_limit_bytes is not None and problem.memory_limit_bytes < 0:
        raise IntraOpError(f"memory_limit_bytes is {problem.memory_limit_bytes}; give a non-negative budget or None")


def evaluate(problem: IntraOpProblem, choice: Sequence[int]) -> float:
    """Exact float objective of `choice`: node compute + comm plus every edge's resharding."""
    if len(choice) != len(problem.nodes):
        raise IntraOpError(f"choice has {len(choice)} entries for {len(problem.nodes)} nodes")
    for k, (node, c) in enumerate(zip(problem.nodes, choice)):
        if not 0 <= c < len(node.strategies):
            raise IntraOpError(f"choice {c} for node {k} ({node.name!r}) is out of range 0..{len(node.strategies) - 1}")
    total = sum(n.strategies[c].compute_s + n.strategies[c].comm_s for n, c in zip(problem.nodes, choice))
    total += sum(e.cost_s[choice[e.src]][choice[e.dst]] for e in problem.edges)
    return float(total)


def peak_bytes(problem: IntraOpProblem, choice: Sequence[int]) -> int:
    """Largest per-device memory over the program points (live sets) under `choice`; 0 without live sets."""
    return max((sum(problem.nodes[v].strategies[choice[v]].memory_bytes for v in set(live))
                for live in problem.live_sets), default=0)


def _memory_rows(problem: IntraOpProblem, leaders: list[int], index: dict[int, int]) -> list[dict[int, np.ndarray]]:
    """Per live set: free node -> bytes per strategy of the live nodes that copy it."""
    rows = []
    for live in problem.live_sets:
        row: dict[int, np.ndarray] = {}
        for v in sorted(set(live)):
            j = index[leaders[v]]
            row[j] = row.get(j, 0) + np.array([s.memory_bytes for s in problem.nodes[v].strategies], dtype=np.int64)
        rows.append(row)
    return rows


def _least_budget(rows: list[dict[int, np.ndarray]], time_limit_s: float) -> tuple[int, bool]:
    """The smallest per-device budget some choice of strategies fits, and whether
    that figure is exact (one program point, or the small model solved in time);
    otherwise it is a lower bound."""
    floors = [int(sum(m.min() for m in row.values())) for row in rows]
    if len(rows) <= 1:
        return max(floors, default=0), True
    model = cp_model.CpModel()
    free = sorted({j for row in rows for j in row})
    size = {j: len(m) for row in rows for j, m in row.items()}
    x = {j: [model.NewBoolVar(f"x{j}_{i}") for i in range(size[j])] for j in free}
    for xs in x.values():
        model.AddExactlyOne(xs)
    top = sum(int(max(m.max() for m in row.values())) for row in rows)
    budget = model.NewIntVar(0, top, "budget")
    for row in rows:
        model.Add(sum(int(b) * x[j][i] for j, m in row.items() for i, b in enumerate(m)) <= budget)
    model.Minimize(budget)
    solver = cp_solver(time_limit_s)
    status = solver.Solve(model)
    if status == cp_model.OPTIMAL:
        return int(solver.ObjectiveValue()), True
    return max(max(floors), int(solver.BestObjectiveBound())), False


def _no_fit(limit: int, rows: list[dict[int, np.ndarray]], time_limit_s: float) -> IntraOpError:
    least, exact = _least_budget(rows, time_limit_s)
    return IntraOpError(
        f"no sharding fits {limit} bytes per device: the smallest budget any sharding fits is "
        f"{'' if exact else 'at least '}{least} bytes ({least / 2**30:.3g} GiB); use more devices, a budget of at "
        f"least {least} bytes, or rematerialization")


def _local_search_start(unary: list[np.ndarray], pairs: dict[tuple[int, int], np.ndarray],
                        first: list[int] | None = None, sweeps: int = 8) -> list[int]:
    """Each node's cheapest strategy given its neighbours', repeated a few sweeps (ICM),
    from `first` (the relaxation's heaviest strategies), else each node's cheapest alone."""
    incident: list[list[tuple[int, np.ndarray]]] = [[] for _ in unary]
    for (a, b), mat in pairs.items():
        incident[a].append((b, mat))
        incident[b].append((a, mat.T))
    choice = list(first) if first is not None else [int(np.argmin(u)) for u in unary]
    for _ in range(sweeps):
        changed = False
        for k, u in enumerate(unary):
            local = u + sum((mat[:, choice[other]] for other, mat in incident[k]), np.zeros_like(u))
            best = int(np.argmin(local))
            changed |= best != choice[k]
            choice[k] = best
        if not changed:
            break
    return choice


def _fit_start(start: list[int], unary: list[np.ndarray], pairs: dict[tuple[int, int], np.ndarray],
               rows: list[dict[int, np.ndarray]], limit: int, sweeps: int = 8) -> list[int]:
    """The cheap start moved into the memory budget. Without this the start of a
    budgeted problem is the unbudgeted one, which a binding budget makes infeasible:
    CP-SAT then has no hint it may keep, and on a large stage (a 7B model's 16 blocks
    on a 2x8 mesh) finds nothing in its time limit. First, while some program point
    holds more than `limit`, the node of the fullest point whose switch frees the most
    bytes per second it adds switches; then the local search of `_local_search_start`
    again, each node taking its cheapest strategy that keeps every point within the
    budget. May still not fit (then the caller does not trust it)."""
    choice = list(start)
    member: list[list[int]] = [[] for _ in unary]  # node -> the program points it is live at
    for r, row in enumerate(rows):
        for j in row:
            member[j].append(r)
    loads = [sum(int(m[choice[j]]) for j, m in row.items()) for row in rows]
    for _ in range(sum(len(u) for u in unary)):  # every move shrinks a node at the fullest point: bounded
        worst = int(np.argmax(loads)) if loads else 0
        if not loads or loads[worst] <= limit:
            break
        moves = [(max(float(unary[j][i] - unary[j][choice[j]]), 0.0) / (int(m[choice[j]]) - int(b)), j, i)
                 for j, m in rows[worst].items() for i, b in enumerate(m) if int(b) < int(m[choice[j]])]
        if not moves:
            return choice
        _, j, i = min(moves)
        for r in member[j]:
            loads[r] += int(rows[r][j][i]) - int(rows[r][j][choice[j]])
        choice[j] = i
    if any(load > limit for load in loads):
        return choice
    incident: list[list[tuple[int, np.ndarray]]] = [[] for _ in unary]
    for (a, b), mat in pairs.items():
        incident[a].append((b, mat))
        incident[b].append((a, mat.T))
    for _ in range(sweeps):
        changed = False
        for k, u in enumerate(unary):
            local = u + sum((mat[:, choice[other]] for other, mat in incident[k]), np.zeros_like(u))
            for i in np.argsort(local, kind="stable"):
                if i == choice[k]:
                    break
                if all(loads[r] + int(rows[r][k][i]) - int(rows[r][k][choice[k]]) <= limit for r in member[k]):
                    for r in member[k]:
                        loads[r] += int(rows[r][k][i]) - int(rows[r][k][choice[k]])
                    choice[k], changed = int(i), True
                    break
        if not changed:
            break
    return choice


def solve_intra_op(problem: IntraOpProblem, time_limit_s: float = 10.0, workers: int = 1,
                   beat: float = math.inf) -> IntraOpSolution | None:
    """Picks one strategy per node minimising total time under the memory limit:
    exactly by elimination where the interaction graph is thin, else from the linear
    relaxation where its optimum is a choice (both deterministic, and proven optimal),
    else by CP-SAT's search. None, before any search, where the relaxation's value
    proves that no choice costs less than `beat` (a caller comparing meshes needs
    no more of a mesh that loses).

    One worker by default: a single-threaded CP-SAT search is deterministic, so the
    driver that plans and every process that compiles a stage (Ray workers, a plan
    file loaded on the cluster) solve to the same shardings, unless the time limit
    cuts the search short. Tied layers keep one worker fast enough (see ilp_time)."""
    started = time.perf_counter()
    _validate(problem)
    leaders = problem.leaders()
    free = sorted(set(leaders))
    index = {r: j for j, r in enumerate(free)}
    rows = _memory_rows(problem, leaders, index)
    limit = problem.memory_limit_bytes
    if limit is not None and any(sum(m.min() for m in row.values()) > limit for row in rows):
        raise _no_fit(limit, rows, time_limit_s)  # fails early: even the smallest strategies overflow

    # Unary cost per free node (its copies' costs added in), plus pairwise matrices per
    # free-node pair. Edges touching a one-strategy node fold into the other node's
    # unary costs; parallel edges merge; an edge between copies of one node keeps only
    # the agreeing pairs.
    unary = [np.zeros(len(problem.nodes[r].strategies)) for r in free]
    for k, node in enumerate(problem.nodes):
        unary[index[leaders[k]]] += [s.compute_s + s.comm_s for s in node.strategies]
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        mat = np.asarray(e.cost_s, dtype=float)
        a, b = index[leaders[e.src]], index[leaders[e.dst]]
        if a == b:
            unary[a] += np.diag(mat)
        elif mat.shape[0] == 1:
            unary[b] += mat[0]
        elif mat.shape[1] == 1:
            unary[a] += mat[:, 0]
        else:
            if a > b:
                a, b, mat = b, a, mat.T
            pairs[(a, b)] = pairs.get((a, b), 0.0) + mat
    # Strategies some other strategy of the same node beats in every context can go
    # (solver.dead_ends): the optimum stays, the model shrinks.
    memory = None
    if limit is not None:
        memory = [np.array([row[j] for row in rows if j in row], dtype=np.int64).reshape(-1, len(u)) for j, u in enumerate(unary)]
    alive = alive_strategies(unary, pairs, memory)
    unary = [u[keep] for u, keep in zip(unary, alive)]
    pairs = {(a, b): mat[np.ix_(alive[a], alive[b])] for (a, b), mat in pairs.items()}
    rows = [{j: m[alive[j]] for j, m in row.items()} for row in rows]
    # Pull each term's minimum into a constant so the integer part is as small as possible.
    constant = 0.0
    for k, u in enumerate(unary):
        constant += u.min()
        unary[k] = u - u.min()
    for key in list(pairs):
        constant += pairs[key].min()
        pairs[key] = pairs[key] - pairs[key].min()
        if not pairs[key].any():  # all entries equal: the edge only adds a constant
            del pairs[key]

    def expand(picks: Sequence[int]) -> tuple[int, ...]:
        return tuple(int(alive[index[r]][picks[index[r]]]) for r in leaders)

    # Without a budget that can bind, the problem is a sum of unary and pairwise
    # costs: exact by elimination where the interaction graph is thin (solver.elimination);
    # else, budget or not, exact where the linear relaxation's optimum is a choice.
    binding = limit is not None and any(sum(int(m.max()) for m in row.values()) > limit for row in rows)
    exact = None if binding else min_sum(unary, pairs, max_work=int(time_limit_s * _ELIMINATED_PER_S))
    relaxation = None if exact is not None else relaxed(unary, pairs, rows, limit, time_limit_s)
    if relaxation is not None and constant + relaxation.value >= beat * _BOUND_MARGIN:
        return None  # no choice beats `beat`: the relaxation's value bounds them all
    picks = exact[0] if exact is not None else relaxation.integral_choice() if relaxation is not None else None
    if picks is not None and (not binding or peak_bytes(problem, expand(picks)) <= limit):
        choice = expand(picks)
        cost = evaluate(problem, choice)
        return IntraOpSolution(choice=choice, cost_s=cost, bound_s=cost, optimal=True, gap=0.0,
                               solve_s=time.perf_counter() - started)

    largest = max([u.max() for u in unary] + [m.max() for m in pairs.values()], default=0.0)
    total_max = sum(u.max() for u in unary) + sum(m.max() for m in pairs.values())
    scale = min(_SCALE_TARGET / largest, _TOTAL_CAP / total_max) if largest > 0 else 1.0

    # A complete, cheap starting point: CP-SAT on a large model can spend a short time
    # limit in presolve and find nothing; the start is then what we return.
    start = _local_search_start(unary, pairs, None if relaxation is None else relaxation.heaviest())
    if limit is not None:
        start = _fit_start(start, unary, pairs, rows, limit)
    start_ok = limit is None or peak_bytes(problem, expand(start)) <= limit

    model = cp_model.CpModel()
    x = [[model.NewBoolVar(f"x{j}_{i}") for i in range(len(u))] for j, u in enumerate(unary)]
    objective = []
    for j, xs in enumerate(x):
        model.AddExactlyOne(xs)
        objective += [int(round(c * scale)) * v for c, v in zip(unary[j], xs) if round(c * scale)]
        for i, v in enumerate(xs):
            model.AddHint(v, int(i == start[j]))
    for (a, b), mat in pairs.items():
        # e[i][j] = x[a][i] AND x[b][j], via marginals: rows sum to x[a], columns to x[b].
        ev = [[model.NewBoolVar(f"e{a}_{b}_{i}_{j}") for j in range(mat.shape[1])] for i in range(mat.shape[0])]
        for i in range(mat.shape[0]):
            model.Add(sum(ev[i]) == x[a][i])
        for j in range(mat.shape[1]):
            model.Add(sum(ev[i][j] for i in range(mat.shape[0])) == x[b][j])
        for i in range(mat.shape[0]):
            for j in range(mat.shape[1]):
                model.AddHint(ev[i][j], int(i == start[a] and j == start[b]))
        objective += [int(round(mat[i, j] * scale)) * ev[i][j]
                      for i in range(mat.shape[0]) for j in range(mat.shape[1]) if round(mat[i, j] * scale)]
    if limit is not None:
        for row in rows:
            if sum(int(m.max()) for m in row.values()) <= limit:
                continue  # cannot be violated
            model.Add(sum(int(b) * x[j][i] for j, m in row.items() for i, b in enumerate(m)) <= int(limit))
    model.Minimize(sum(objective))

    solver = cp_solver(time_limit_s, num_workers=workers, seed=0)
    # Presolve has little to simplify in this model (exactly-one rows and the pair
    # variables' marginals) but, on a 7B stage's tens of thousands of pair variables,
    # took about two thirds of the time to a proven optimum.
    solver.parameters.cp_model_presolve = False
    status = solver.Solve(model)
    if status == cp_model.INFEASIBLE:
        raise _no_fit(int(limit), rows, time_limit_s)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = expand([next(i for i, v in enumerate(xs) if solver.BooleanValue(v)) for xs in x])
        if status == cp_model.FEASIBLE and start_ok and evaluate(problem, expand(start)) < evaluate(problem, choice):
            choice = expand(start)  # the solver ignored a better start
    elif status == cp_model.UNKNOWN and start_ok:
        choice = expand(start)
    else:
        raise IntraOpError(
            f"the sharding solver found no solution within {time_limit_s} s ({solver.StatusName(status)}) for "
            f"{len(problem.nodes)} nodes and {len(problem.edges)} edges; give solve_intra_op a longer time_limit_s")
    cost = evaluate(problem, choice)
    optimal = status == cp_model.OPTIMAL
    # The constant is a proven bound by itself: every remaining integer term is >= 0.
    proved = constant + max(0.0, solver.BestObjectiveBound() / scale) if status == cp_model.FEASIBLE else constant
    bound = cost if optimal else min(cost, proved)
    gap = 0.0 if optimal or cost <= 0 else min(1.0, max(0.0, (cost - bound) / cost))
    elapsed = time.perf_counter() - started
    if not optimal:
        log.warning("intra-op sharding solve hit its %.3g s time limit: returning a choice within %.2f%% of optimal "
                    "(cost %.6g s, bound %.6g s); raise time_limit_s for a proven optimum", time_limit_s,
                    100 * gap, cost, bound)
    return IntraOpSolution(choice=choice, cost_s=cost, bound_s=bound, optimal=optimal, gap=gap, solve_s=elapsed)

"""The sharding problem's linear relaxation (solver/lp_relaxation.py): where its
optimum is integral it is brute force's optimum, and the solver then answers without
a CP-SAT search; where it is fractional the search still finds the optimum."""

from __future__ import annotations

import numpy as np
import pytest

import solver.intra_op as intra_op
from solver.intra_op import Edge, IntraOpProblem, Node, Strategy, evaluate, peak_bytes, solve_intra_op
from solver.lp_relaxation import relaxed
from test_intra_op_solver import brute, random_problem


def _terms(problem: IntraOpProblem) -> tuple[list[np.ndarray], dict, list[dict[int, np.ndarray]]]:
    """The problem as the relaxation takes it (no tied nodes): costs per node, per
    pair of nodes (parallel edges summed), and bytes per program point."""
    unary = [np.array([s.compute_s + s.comm_s for s in node.strategies]) for node in problem.nodes]
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        pairs[(e.src, e.dst)] = pairs.get((e.src, e.dst), 0.0) + np.array(e.cost_s)
    rows = [{v: np.array([s.memory_bytes for s in problem.nodes[v].strategies]) for v in set(live)}
            for live in problem.live_sets]
    return unary, pairs, rows


@pytest.mark.parametrize("seed", range(30))
def test_an_integral_relaxation_is_the_optimum_and_any_bounds_it(seed):
    problem = random_problem(np.random.default_rng(seed))
    unary, pairs, rows = _terms(problem)
    relaxation = relaxed(unary, pairs, rows, problem.memory_limit_bytes)
    best = brute(problem)
    assert relaxation.value <= best * (1 + 1e-9) + 1e-12
    choice = relaxation.integral_choice()
    if choice is None:
        return  # fractional: the search's turn (counted below)
    assert evaluate(problem, choice) == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert relaxation.value == pytest.approx(best, rel=1e-7, abs=1e-12)
    if problem.memory_limit_bytes is not None:
        assert peak_bytes(problem, choice) <= problem.memory_limit_bytes


def test_the_relaxation_of_a_chain_is_always_integral():
    """On a tree the relaxation is exact, so every free chain gets its optimum from it
    (this also keeps the property test above from passing on fractional answers alone)."""
    for seed in range(20):
        rng = np.random.default_rng(1000 + seed)
        nodes = tuple(Node(f"op{i}", tuple(Strategy(f"s{j}", float(rng.uniform()), 0.0, 1) for j in range(int(rng.integers(2, 5)))))
                      for i in range(5))
        edges = tuple(Edge(i, i + 1, tuple(tuple(float(x) for x in row) for row in
                                           rng.uniform(0, 1, (len(nodes[i].strategies), len(nodes[i + 1].strategies)))))
                      for i in range(4))
        problem = IntraOpProblem(nodes, edges)
        choice = relaxed(*_terms(problem)[:2]).integral_choice()
        assert choice is not None, f"seed {seed}: a chain's relaxation came out fractional"
        assert evaluate(problem, choice) == pytest.approx(brute(problem), rel=1e-9)


def _dense(seed: int) -> IntraOpProblem:
    """Every node joined to the next two: cycles, which elimination would still solve."""
    rng = np.random.default_rng(seed)
    nodes = tuple(Node(f"op{i}", tuple(Strategy(f"s{j}", float(rng.uniform()), 0.0, 1) for j in range(3))) for i in range(7))
    edges = tuple(Edge(i, j, tuple(tuple(float(x) for x in row) for row in rng.uniform(0, 1, (3, 3))))
                  for i in range(7) for j in (i + 1, i + 2) if j < 7)
    return IntraOpProblem(nodes, edges)


def test_where_elimination_is_refused_an_integral_relaxation_answers_without_a_search(monkeypatch):
    monkeypatch.setattr(intra_op, "_ELIMINATED_PER_S", 0)  # elimination over its budget at once

    def no_search(*args, **kwargs):
        raise AssertionError("CP-SAT was asked, though the relaxation's optimum was integral")

    answered = 0
    for seed in range(12):
        problem = _dense(seed)
        if relaxed(*_terms(problem)[:2]).integral_choice() is None:
            continue
        with monkeypatch.context() as m:
            m.setattr(intra_op, "cp_solver", no_search)
            solution = solve_intra_op(problem)
        assert solution.optimal and solution.gap == 0.0
        assert solution.cost_s == pytest.approx(brute(problem), rel=1e-9)
        answered += 1
    assert answered >= 6


def test_a_fractional_relaxation_leaves_the_optimum_to_the_search(monkeypatch):
    """Three operators in a cycle, each pair paying to agree: every choice has a pair
    that agrees, while the relaxation splits each operator half and half and pays
    nothing. The relaxation gives no choice; the search finds the optimum."""
    monkeypatch.setattr(intra_op, "_ELIMINATED_PER_S", 0)
    nodes = tuple(Node(f"op{i}", (Strategy("rows", 1.0, 0.0, 1), Strategy("cols", 1.0, 0.0, 1))) for i in range(3))
    agree = ((1.0, 0.0), (0.0, 1.0))
    problem = IntraOpProblem(nodes, (Edge(0, 1, agree), Edge(1, 2, agree), Edge(0, 2, agree)))
    relaxation = relaxed(*_terms(problem)[:2])
    assert relaxation.integral_choice() is None and relaxation.value == pytest.approx(3.0)
    solution = solve_intra_op(problem)
    assert solution.optimal and solution.cost_s == pytest.approx(brute(problem)) == pytest.approx(4.0)


def test_a_problem_whose_relaxation_exceeds_beat_is_refused_before_its_search(monkeypatch):
    """A caller comparing meshes passes the cheapest so far (`beat`): where the
    relaxation's value already exceeds it, no search runs and the answer is None;
    below it, the search answers as without `beat`."""
    monkeypatch.setattr(intra_op, "_ELIMINATED_PER_S", 0)
    nodes = tuple(Node(f"op{i}", (Strategy("rows", 1.0, 0.0, 1), Strategy("cols", 1.0, 0.0, 1))) for i in range(3))
    agree = ((1.0, 0.0), (0.0, 1.0))
    problem = IntraOpProblem(nodes, (Edge(0, 1, agree), Edge(1, 2, agree), Edge(0, 2, agree)))  # relaxation 3, optimum 4
    with monkeypatch.context() as m:
        m.setattr(intra_op, "cp_solver", lambda *a, **k: pytest.fail("searched a problem its relaxation refuses"))
        assert solve_intra_op(problem, beat=2.5) is None
    assert solve_intra_op(problem, beat=3.5).cost_s == pytest.approx(4.0)  # the bound does not refuse: the search's optimum

"""The intra-op sharding ILP against brute force, and its errors."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from solver.intra_op import Edge, IntraOpError, IntraOpProblem, Node, Strategy, evaluate, peak_bytes, solve_intra_op


def brute(problem: IntraOpProblem) -> float:
    best = float("inf")
    for choice in itertools.product(*(range(len(n.strategies)) for n in problem.nodes)):
        if problem.memory_limit_bytes is not None and peak_bytes(problem, choice) > problem.memory_limit_bytes:
            continue
        best = min(best, evaluate(problem, choice))
    return best


def random_problem(rng: np.random.Generator) -> IntraOpProblem:
    n = int(rng.integers(3, 7))
    nodes = tuple(
        Node(f"op{i}", tuple(Strategy(f"s{j}", float(rng.uniform(0, 1)), float(rng.uniform(0, 0.5)), int(rng.integers(1, 100)))
                             for j in range(int(rng.integers(2, 5)))))
        for i in range(n)
    )
    edges = [(i, i + 1) for i in range(n - 1)] + [tuple(sorted(rng.choice(n, 2, replace=False))) for _ in range(int(rng.integers(0, 3)))]
    edges = tuple(Edge(int(a), int(b), tuple(tuple(float(x) for x in row) for row in
                                             rng.uniform(0, 1, (len(nodes[a].strategies), len(nodes[b].strategies)))
                                             * (rng.uniform(size=(len(nodes[a].strategies), len(nodes[b].strategies))) > 0.3)))
                  for a, b in edges)
    if rng.uniform() < 0.5:
        live = tuple(tuple(range(i, min(n, i + 3))) for i in range(n))
        least = max(sum(min(s.memory_bytes for s in nodes[i].strategies) for i in group) for group in live)
        return IntraOpProblem(nodes, edges, int(least * rng.uniform(1.0, 1.6)), live)
    return IntraOpProblem(nodes, edges)


def test_resharding_cost_changes_the_joint_choice():
    # Each operator alone prefers its first strategy, but they disagree on the layout,
    # and resharding between them costs more than taking the second strategy of b.
    a = Node("a", (Strategy("rows", 1.0, 0.0, 1), Strategy("cols", 1.5, 0.0, 1)))
    b = Node("b", (Strategy("cols", 1.0, 0.0, 1), Strategy("rows", 1.2, 0.0, 1)))
    reshard = Edge(0, 1, ((5.0, 0.0), (0.0, 5.0)))
    solution = solve_intra_op(IntraOpProblem((a, b), (reshard,)))
    assert solution.names(IntraOpProblem((a, b), (reshard,))) == ["rows", "rows"]
    assert solution.cost_s == pytest.approx(2.2)
    assert solution.optimal and solution.gap == 0.0


@pytest.mark.parametrize("seed", range(30))
def test_matches_brute_force(seed):
    problem = random_problem(np.random.default_rng(seed))
    expected = brute(problem)
    solution = solve_intra_op(problem)
    assert solution.optimal
    assert solution.cost_s == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert solution.cost_s == pytest.approx(evaluate(problem, solution.choice))
    if problem.memory_limit_bytes is not None:
        assert peak_bytes(problem, solution.choice) <= problem.memory_limit_bytes


def test_memory_limit_moves_the_choice():
    replicated = Strategy("replicated", 1.0, 0.0, 100)
    sharded = Strategy("sharded", 1.0, 0.5, 25)
    nodes = (Node("w1", (replicated, sharded)), Node("w2", (replicated, sharded)))
    free = solve_intra_op(IntraOpProblem(nodes))
    tight = solve_intra_op(IntraOpProblem(nodes, (), memory_limit_bytes=130, live_sets=((0, 1),)))
    assert free.choice == (0, 0)
    assert sorted(tight.choice) == [0, 1] and tight.cost_s == pytest.approx(2.5)


def test_nothing_fits_names_the_smallest_figure():
    nodes = (Node("w", (Strategy("r", 1.0, 0.0, 100), Strategy("s", 1.0, 0.0, 60))),)
    with pytest.raises(IntraOpError, match="smallest budget any sharding fits is 60 bytes"):
        solve_intra_op(IntraOpProblem(nodes, (), memory_limit_bytes=50, live_sets=((0,),)))


def test_tied_program_points_name_the_least_budget():
    # Each program point alone fits 50 bytes, but c and its copy d want opposite strategies.
    c = Node("c", (Strategy("r", 1.0, 0.0, 10), Strategy("s", 1.0, 0.0, 90)))
    d = Node("d", (Strategy("r", 1.0, 0.0, 90), Strategy("s", 1.0, 0.0, 10)))
    e = Node("e", (Strategy("r", 1.0, 0.0, 30), Strategy("s", 1.0, 0.0, 40)))
    problem = IntraOpProblem((c, d, e), (), memory_limit_bytes=50, live_sets=((0, 2), (1, 2)), same_as=(0, 0, 2))
    least = min(max(sum(problem.nodes[v].strategies[choice[v]].memory_bytes for v in live) for live in problem.live_sets)
                for choice in itertools.product(range(2), repeat=3) if choice[0] == choice[1])
    assert least == 120
    with pytest.raises(IntraOpError, match=f"smallest budget any sharding fits is {least} bytes"):
        solve_intra_op(problem)


def tied_brute(problem: IntraOpProblem) -> float:
    best = float("inf")
    for choice in itertools.product(*(range(len(n.strategies)) for n in problem.nodes)):
        if any(choice[k] != choice[r] for k, r in enumerate(problem.same_as)):
            continue
        if problem.memory_limit_bytes is not None and peak_bytes(problem, choice) > problem.memory_limit_bytes:
            continue
        best = min(best, evaluate(problem, choice))
    return best


@pytest.mark.parametrize("seed", range(25))
def test_tied_nodes_solve_to_the_best_agreeing_choice(seed):
    rng = np.random.default_rng(100 + seed)
    base = random_problem(rng)
    # Tie a random set of nodes with as many strategies as an earlier node to that node.
    same_as = list(range(len(base.nodes)))
    for k, node in enumerate(base.nodes):
        earlier = [r for r in range(k) if same_as[r] == r and len(base.nodes[r].strategies) == len(node.strategies)]
        if earlier and rng.uniform() < 0.6:
            same_as[k] = int(rng.choice(earlier))
    problem = IntraOpProblem(base.nodes, base.edges, base.memory_limit_bytes, base.live_sets, tuple(same_as))
    expected = tied_brute(problem)
    if expected == float("inf"):
        with pytest.raises(IntraOpError, match="smallest budget"):
            solve_intra_op(problem)
        return
    solution = solve_intra_op(problem)
    assert all(solution.choice[k] == solution.choice[r] for k, r in enumerate(same_as))
    assert solution.cost_s == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_bad_ties_are_named():
    one = Node("a", (Strategy("r", 1.0, 0.0, 1),))
    two = Node("b", (Strategy("r", 1.0, 0.0, 1), Strategy("s", 1.0, 0.0, 1)))
    with pytest.raises(IntraOpError, match="only tie operators with the same strategies"):
        solve_intra_op(IntraOpProblem((one, two), same_as=(0, 0)))
    with pytest.raises(IntraOpError, match="not a free node"):
        solve_intra_op(IntraOpProblem((two, two, two), same_as=(1, 0, 0)))
    with pytest.raises(IntraOpError, match="one per node"):
        solve_intra_op(IntraOpProblem((two, two), same_as=(0,)))


def test_malformed_problems_are_named():
    one = Node("a", (Strategy("r", 1.0, 0.0, 1),))
    two = Node("b", (Strategy("r", 1.0, 0.0, 1), Strategy("s", 1.0, 0.0, 1)))
    with pytest.raises(IntraOpError, match="needs \\(1, 2\\)"):
        solve_intra_op(IntraOpProblem((one, two), (Edge(0, 1, ((0.0,),)),)))
    with pytest.raises(IntraOpError, match="does not exist"):
        solve_intra_op(IntraOpProblem((one,), (Edge(0, 3, ((0.0,),)),)))
    with pytest.raises(IntraOpError, match="no sharding strategy"):
        solve_intra_op(IntraOpProblem((Node("empty", ()),)))


def test_time_limit_returns_the_best_found_and_its_gap():
    rng = np.random.default_rng(0)
    nodes = tuple(Node(f"op{i}", tuple(Strategy(f"s{j}", float(rng.uniform()), 0.0, 1) for j in range(6))) for i in range(300))
    pairs = [(i, i + 1) for i in range(299)] + [tuple(sorted(rng.choice(300, 2, replace=False))) for _ in range(200)]
    edges = tuple(Edge(int(a), int(b), tuple(tuple(float(x) for x in row) for row in rng.uniform(0, 1, (6, 6)))) for a, b in pairs)
    problem = IntraOpProblem(nodes, edges)
    started = time.perf_counter()
    solution = solve_intra_op(problem, time_limit_s=0.2)
    assert time.perf_counter() - started < 60  # the limit stops the search (generous: a loaded host is slow to build the model)
    assert solution.cost_s == pytest.approx(evaluate(problem, solution.choice))
    assert solution.bound_s <= solution.cost_s
    assert 0.0 <= solution.gap <= 1.0
    assert solution.optimal or solution.gap > 0


def test_some_random_memory_limits_exclude_the_free_optimum():
    # Guards the property test above: it must include instances where memory binds.
    binding = 0
    for seed in range(30):
        problem = random_problem(np.random.default_rng(seed))
        if problem.memory_limit_bytes is None:
            continue
        free = brute(IntraOpProblem(problem.nodes, problem.edges))
        binding += brute(problem) > free * (1 + 1e-9)
    assert binding >= 3


def test_negative_costs_and_bad_choices_are_rejected():
    with pytest.raises(IntraOpError, match="finite and >= 0"):
        solve_intra_op(IntraOpProblem((Node("a", (Strategy("r", -1.0, 0.0, 1),)),)))
    two = Node("b", (Strategy("r", 1.0, 0.0, 1), Strategy("s", 1.0, 0.0, 1)))
    with pytest.raises(IntraOpError, match="finite and >= 0"):
        solve_intra_op(IntraOpProblem((two, two), (Edge(0, 1, ((0.0, -2.0), (0.0, 0.0))),)))
    with pytest.raises(IntraOpError, match="out of range"):
        evaluate(IntraOpProblem((two,)), (2,))


def test_single_strategy_nodes_and_constant_edges_fold_away():
    one = Node("fixed", (Strategy("r", 0.5, 0.0, 1),))
    two = Node("b", (Strategy("r", 1.0, 0.0, 1), Strategy("s", 1.1, 0.0, 1)))
    edges = (Edge(0, 1, ((3.0, 0.0),)), Edge(1, 2, ((0.7, 0.7), (0.7, 0.7))), Edge(2, 1, ((0.0, 0.2), (0.2, 0.0))))
    problem = IntraOpProblem((one, two, two), edges)
    solution = solve_intra_op(problem)
    assert solution.choice == (0, 1, 1)
    assert solution.cost_s == pytest.approx(0.5 + 1.1 + 1.1 + 0.7)


def test_solver_package_does_not_import_jax():
    import subprocess
    import sys

    code = "import sys, solver.intra_op; assert 'jax' not in sys.modules, 'solver.intra_op imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_equal_optima_resolve_the_same_way_every_time():
    # Every process that compiles a stage re-solves its sharding: they must agree.
    rng = np.random.default_rng(7)
    nodes = tuple(Node(f"op{i}", tuple(Strategy(f"s{j}", 1.0, 0.0, 1) for j in range(4))) for i in range(40))
    edges = tuple(Edge(i, i + 1, tuple(tuple(float(rng.integers(0, 2)) for _ in range(4)) for _ in range(4))) for i in range(39))
    problem = IntraOpProblem(nodes, edges)
    choices = {solve_intra_op(problem).choice for _ in range(5)}
    assert len(choices) == 1


def test_a_budget_the_fast_start_breaks_still_gets_an_answer_that_fits():
    """Where the budget binds, the unbudgeted start overflows it; with no time to search
    (as a 7B stage on a 2x8 mesh had in 5 s) the answer is the start moved into the
    budget, not an error."""
    n = 40
    strategies = (Strategy("fast", 0.0, 0.0, 10), Strategy("mid", 0.5, 0.0, 4), Strategy("small", 1.0, 0.0, 1))
    nodes = tuple(Node(f"n{k}", strategies) for k in range(n))
    agree = tuple(tuple(0.0 if i == j else 0.3 for j in range(3)) for i in range(3))
    edges = tuple(Edge(k, k + 1, agree) for k in range(n - 1))
    problem = IntraOpProblem(nodes, edges, memory_limit_bytes=150, live_sets=(tuple(range(n)),))
    solution = solve_intra_op(problem, time_limit_s=1e-9)
    assert peak_bytes(problem, solution.choice) <= 150
    assert solution.cost_s == pytest.approx(evaluate(problem, solution.choice))


def test_dead_ends_go_and_an_optimum_stays():
    from solver.dead_ends import alive_strategies

    # Node 0: strategy 2 costs 1 more than strategy 0 whatever node 1 does (a dead end);
    # strategies 0 and 1 are equal in every context (one of them stays).
    unary = [np.array([1.0, 1.0, 2.0]), np.array([0.0, 0.5])]
    pairs = {(0, 1): np.array([[0.0, 3.0], [0.0, 3.0], [0.0, 3.0]])}
    assert [a.tolist() for a in alive_strategies(unary, pairs)] == [[0], [0]]  # node 1's second always costs more
    # A dearer strategy that holds fewer bytes must stay where memory is constrained.
    memory = [np.array([[10, 10, 1]]), np.zeros((0, 2), dtype=np.int64)]
    assert alive_strategies(unary, pairs, memory)[0].tolist() == [0, 2]
    # On random problems the survivors still hold an optimum (brute force over them).
    pruned = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        sizes = rng.integers(2, 5, 4)
        unary = [rng.uniform(0, 1, k) for k in sizes]
        pairs = {(a, b): rng.uniform(0, 0.3, (sizes[a], sizes[b])) for a, b in ((0, 1), (1, 2), (2, 3), (0, 3))}
        cost = lambda c: sum(unary[k][c[k]] for k in range(4)) + sum(m[c[a], c[b]] for (a, b), m in pairs.items())  # noqa: E731
        alive = alive_strategies(unary, pairs)
        pruned += sum(sizes) - sum(len(a) for a in alive)
        everything = min(cost(c) for c in itertools.product(*(range(k) for k in sizes)))
        assert min(cost(c) for c in itertools.product(*alive)) == pytest.approx(everything, abs=1e-12)
    assert pruned > 0


@pytest.mark.parametrize("seed", range(4))
def test_elimination_finds_the_optimum_of_a_graph_with_cycles(seed):
    """Without a memory budget the solver eliminates variables (solver.elimination)
    instead of calling CP-SAT: on a denser graph than a chain (every node joined to the
    next two) it must still find brute force's optimum, and report it as its cost."""
    from solver.elimination import min_sum

    rng = np.random.default_rng(seed)
    n, k = 8, 3
    nodes = tuple(Node(f"op{i}", tuple(Strategy(f"s{j}", float(rng.uniform()), 0.0, 1) for j in range(k))) for i in range(n))
    edges = tuple(Edge(i, j, tuple(tuple(float(x) for x in row) for row in rng.uniform(0, 1, (k, k))))
                  for i in range(n) for j in (i + 1, i + 2) if j < n)
    problem = IntraOpProblem(nodes, edges)
    solution = solve_intra_op(problem)
    assert solution.optimal and solution.cost_s == pytest.approx(brute(problem), rel=1e-12)
    unary = [np.array([s.compute_s for s in node.strategies]) for node in nodes]
    choice, least = min_sum(unary, {(e.src, e.dst): np.array(e.cost_s) for e in edges})
    assert least == pytest.approx(evaluate(problem, choice), rel=1e-12) and least == pytest.approx(brute(problem), rel=1e-12)
    assert min_sum(unary, {(e.src, e.dst): np.array(e.cost_s) for e in edges}, max_work=10) is None  # past its budget: CP-SAT's turn

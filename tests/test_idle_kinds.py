"""Every device kind is used, or the plan says why: when the planner's best plan
leaves a kind idle, a note gives the number that decided it (how much slower the
best plan using every kind is), the summary lists the kind as idle, and
`use_all_kinds` plans with every kind, with parity."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

import hetpar
from models import gpt
from parity import run_parity
from solver.collectives import LinkCost
from solver.planner import DeviceKind, LayerCost, Planner, PlanningError, Problem, plan
from test_planner import random_problem

FAST_SLOW = {"A100": 4, "V100": 4}


def _problem(**options) -> Problem:
    link = LinkCost(1e11, 1e-6)
    kinds = (DeviceKind("fast", 4, 4, 1e14, 2**36, 2e12, link, link), DeviceKind("slow", 4, 4, 1e12, 2**36, 1e12, link, link))
    layers = tuple(LayerCost(1e10, 3e9, 2**24, 2**20, 2**18) for _ in range(8))
    return Problem(layers, kinds, 16, (("fast", "slow", LinkCost(1e9, 1e-5)),), **options)


def test_the_planner_uses_every_kind_when_asked():
    alone = plan(_problem()).best
    assert {s.kind for s in alone.stages} == {"fast"}  # a kind 100x slower only slows the step down
    every = plan(_problem(use_all_kinds=True)).best
    assert {s.kind for s in every.stages} == {"fast", "slow"} and every.step_s > alone.step_s


def test_after_its_search_the_planner_finds_the_best_plan_using_every_kind_as_a_fresh_one_does():
    """The idle-kind note's search reuses the planner's tables, pipelines and each
    kind's own plan (`Planner.requiring_every_kind`): it must find what a fresh
    planner of the same problem with `use_all_kinds` finds, plan and bound alike."""
    problems = [_problem()] + [random_problem(np.random.default_rng(seed), kinds=3) for seed in range(8)]
    compared = 0
    for problem in problems:
        planner = Planner(problem)
        try:
            planner.solve()
            fresh = plan(replace(problem, use_all_kinds=True), top_k=1)
        except PlanningError:
            continue
        shared = planner.requiring_every_kind().solve()
        assert [shared.best.describe(), shared.best.step_s, shared.per_kind] == [fresh.best.describe(), fresh.best.step_s, fresh.per_kind]
        assert {s.kind for s in shared.best.stages} == {k.name for k in problem.kinds}
        compared += 1
    assert compared >= 5


def test_an_idle_kind_is_named_with_the_cost_of_using_it():
    w = gpt.setup(batch_size=8)
    made = hetpar.make_plan(w.step, (w.state, w.batch), hetpar.Cluster.virtual(FAST_SLOW), num_microbatches=1)
    assert {s.device_type for s in made.stages} == {"A100"}
    note = next(n for n in made.notes if "idle" in n)
    ratio = float(re.search(r"is ([0-9.]+)x slower", note).group(1))
    assert note.startswith("V100 x4 idle") and ratio >= 1.0 and "use_all_kinds" in note
    assert "(idle: 4xV100)" in str(made)


def test_a_plan_using_every_kind_runs_with_parity():
    w = gpt.setup(batch_size=8)
    used = run_parity(w, hetpar.Cluster.virtual(FAST_SLOW), steps=2, num_microbatches=2,
                      stage_option=hetpar.StageOption(use_all_kinds=True))
    assert {s.device_type for s in used.stages} == {"A100", "V100"} and not used.idle_groups()

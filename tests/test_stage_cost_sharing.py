"""The stage tables' shared work gives each stage its own figures.

Two shortcuts the planner's search takes for speed must not change a number: per-layer
times priced once per (kind, model axis, examples per device) instead of per stage
(`StageCosts.times_key`), and every (ZeRO stage, recomputation) choice's memory priced at
once (`solver.cost.choice_memory`) instead of one `variant` each.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from solver.cost.stage_costs import StageCosts
from solver.planner.layouts import kind_layouts
from test_planner import random_problem


def _stages(problem):  # noqa: ANN001, ANN202
    """Every stage shape the search may build, with each microbatch size it may run."""
    for kind in problem.kinds:
        for lay in kind_layouts(problem, kind.name):
            for m in problem.microbatch_counts():
                b = problem.batch_size // m
                if not b % lay.dp:
                    yield lay.config, b


def test_shared_layer_times_are_each_stages_own():
    shared = 0
    for seed in range(12):
        problem = random_problem(np.random.default_rng(seed))
        costs = StageCosts(problem)
        for cfg, b in _stages(problem):
            layer = costs.per_layer(cfg, b)
            own = costs._layer_times_uncached((cfg, b))  # this stage's own, nothing shared
            for got, want in zip((layer.forward, layer.backward, layer.rerun), own):
                assert np.array_equal(got, want)
            shared += costs.times_key(cfg, b) != (cfg, b)
    assert shared > 20  # the shortcut was taken


def test_shapes_with_as_many_examples_per_device_share_their_times():
    problem = random_problem(np.random.default_rng(3), kinds=1)
    costs = StageCosts(problem)
    keys = [costs.times_key(cfg, b) for cfg, b in _stages(problem)]
    assert len(set(keys)) < len(keys)


@pytest.mark.parametrize("checkpoints", [False, True])
def test_every_choices_memory_is_its_variants(checkpoints):
    compared = set()
    for seed in range(12):
        problem = random_problem(np.random.default_rng(seed))
        problem = replace(problem, allow_remat=True, layer_checkpoints=checkpoints)
        costs = StageCosts(problem)
        for cfg, b in _stages(problem):
            choices = costs._table_times(cfg, b, 1)[0]
            for last in (False, True):
                for held in (1, 2, 5):
                    totals = costs._choice_memory.totals(cfg, b, held, last, choices)
                    for row, (zero, remat) in zip(totals, choices):
                        want = costs.variant(cfg, b, held, last, zero, remat).memory.total
                        assert np.array_equal(row, np.broadcast_to(want, row.shape))
                        compared.add((zero > 0, bool(remat), last))
    assert len(compared) == 8  # ZeRO or not, recomputing or not, last or not: each compared


def test_a_table_picks_each_ranges_first_fastest_choice_that_fits_by_its_variant():
    """The device tables work on the layer ranges alone (`solver.cost.device_table`): each
    range's entry is still the first of the fastest choices that fit, with that choice's
    `variant` figures, and nothing where no range exists or nothing fits."""
    picked = unfit = 0
    for seed in range(6):
        problem = replace(random_problem(np.random.default_rng(seed)), allow_remat=True, offload_tiers=("",))
        costs = StageCosts(problem)
        for cfg, b in list(_stages(problem))[:6]:
            choices = costs._table_times(cfg, b, 1)[0]
            for held, last, m in ((1, True, 2), (3, False, 4)):
                table = costs.table(cfg, b, held, last, m)
                variants = [costs.variant(cfg, b, held, last, z, r) for z, r in choices]
                for i in range(costs.n + 1):
                    for j in range(costs.n + 1):
                        costs_ij = [m * (v.forward + v.backward)[i, j] + np.broadcast_to(v.tail, v.forward.shape)[i, j]
                                    if np.broadcast_to(v.memory.total, v.forward.shape)[i, j] <= table.capacity else np.inf
                                    for v in variants]  # what a step of m microbatches costs, where the choice fits
                        if j <= i or min(costs_ij) == np.inf:
                            assert table.forward[i, j] == np.inf and table.memory[i, j] == 0 and not table.remat[i, j]
                            unfit += j > i
                            continue
                        k = int(np.argmin(costs_ij))
                        v = variants[k]
                        assert (table.forward[i, j], table.backward[i, j]) == (v.forward[i, j], v.backward[i, j])
                        assert table.memory[i, j] == np.broadcast_to(v.memory.total, v.forward.shape)[i, j]
                        assert (int(table.zero[i, j]), bool(table.remat[i, j])) == (choices[k][0], bool(choices[k][1]))
                        picked += 1
    assert picked > 100 and unfit > 10


@pytest.mark.parametrize("checkpoints, host", [(False, False), (True, False), (False, True)])
def test_a_last_stages_table_is_the_same_at_every_count_where_one_program_holds_one(checkpoints, host):
    """`StageCosts.table` builds a last stage's table once for every microbatch count
    where each choice runs forward and backward as one program (held once): each is
    the table built at its own count, bit for bit; with layer checkpoints (a recomputing
    last stage holds every microbatch's inputs) each count has its own."""
    compared = differ = 0
    for seed in range(8):
        problem = replace(random_problem(np.random.default_rng(seed)), allow_remat=True, layer_checkpoints=checkpoints)
        if host:  # room on the hosts: tables pick among offload tiers too (`variant`'s memory)
            problem = replace(problem, kinds=tuple(replace(k, host_memory_bytes=k.memory_bytes / 4) for k in problem.kinds))
        costs = StageCosts(problem)
        for cfg, b in list(_stages(problem))[:8]:
            m = max(1, problem.batch_size // b)
            for held in (1, 2, 5):
                got, own = costs.table(cfg, b, held, True, m), costs._table(cfg, b, held, True, m)
                for name in ("forward", "backward", "remat", "memory", "tail", "sync", "zero", "offload"):
                    a, w = np.asarray(getattr(got, name)), np.asarray(getattr(own, name))
                    assert a.dtype == w.dtype and a.tobytes() == w.tobytes(), (seed, cfg, b, held, name)
                compared += 1
                differ += costs.table(cfg, b, held, True, m) is not costs.table(cfg, b, 1, True, m)
    assert compared > 100
    assert differ > 0 if checkpoints else differ == 0

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


def _priced_stages(seeds: int):  # noqa: ANN202
    """(costs, stage, microbatch size) of every stage of `seeds` random problems, each
    problem's costs fresh (nothing shared between problems)."""
    for seed in range(seeds):
        problem = random_problem(np.random.default_rng(seed))
        costs = StageCosts(problem)
        for cfg, b in _stages(problem):
            yield costs, cfg, b


def test_shared_layer_times_are_each_stages_own():
    shared = 0
    for costs, cfg, b in _priced_stages(12):
        layer = costs.per_layer(cfg, b)
        own = costs._layer_times_rows(cfg, [b])[0]  # this stage's own, nothing shared
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


def _own_layer_times(costs: StageCosts, cfg, b: float):  # noqa: ANN001, ANN202
    """A stage's modelled layer times as summed before their shared parts were kept
    (`StageCosts._passes`, `_bwd_work`, `_split_share`): every sum from the layers' own arrays."""
    from solver.cost.topologies import tp_allreduce_s
    from solver.efficiency import matmul_rate

    per_device, kind = b / cfg.dp, costs.kinds[cfg.kind]

    def rates(flops, matmuls):  # noqa: ANN001, ANN202
        each = np.where(matmuls > 0, flops * per_device / cfg.tp / np.maximum(matmuls, 1.0), 0.0)
        return np.asarray(matmul_rate(kind.flops, each, kind.matmul_half_flops), dtype=float).reshape(costs.n)

    speed = cfg.tp * rates(costs.fwd_flops, costs.matmuls)
    bwd_speed = cfg.tp * rates(costs.flops - costs.fwd_flops, costs.bwd_matmuls)
    comm = tp_allreduce_s(kind, cfg.tp, costs.tp_bytes * per_device, costs.tp_count)
    trains = float(costs.problem.training)
    streaming = per_device * (costs.elementwise_split / cfg.tp + 1 - costs.elementwise_split) / kind.memory_bandwidth
    forward = costs.fwd_flops * per_device / speed + comm + kind.layer_overhead_s / 3 + costs.elementwise * streaming
    backward = trains * ((costs.flops - costs.fwd_flops + costs.recompute_flops) * per_device / bwd_speed + comm
                         + 2 * kind.layer_overhead_s / 3 + costs.bwd_elementwise * streaming)
    return forward, backward


@pytest.mark.parametrize("training", [True, False])
def test_layer_times_are_the_layers_own_sums(training):
    compared = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        problem = replace(random_problem(rng), training=training)
        layers = tuple(replace(layer, matmuls=float(rng.integers(0, 9)), backward_matmuls=float(rng.integers(0, 3) * 7),
                               recompute_flops=layer.forward_flops * float(rng.integers(0, 2)),
                               elementwise_bytes=float(rng.integers(0, 4)) * 2**24, backward_elementwise_bytes=2.0**25,
                               elementwise_split=float(rng.uniform(0, 1)))
                       for layer in problem.layers)  # every sum's parts: matmul counts, reruns, memory-bound bytes
        problem = replace(problem, layers=layers, kinds=tuple(replace(k, matmul_half_flops=1e9) for k in problem.kinds))
        costs, together = StageCosts(problem), StageCosts(problem)
        stages = list(_stages(problem))
        # alone, and every stage at every size in one pass (`layer_times_of`, a row per size): the same bits
        for (cfg, b), at_once in zip(stages, together.layer_times_of(together.times_key(c, n) for c, n in stages)):
            want = _own_layer_times(costs, cfg, b)
            for got in (costs._layer_times_rows(cfg, [b])[0], at_once):
                for a, w in zip(got, want):
                    assert a.tobytes() == np.asarray(w, dtype=float).tobytes()
            compared += 1
    assert compared > 50



def test_sizes_priced_together_keep_their_own_measured_layers():
    """`layer_times_of` prices a stage's microbatch sizes in one pass; where measured
    layers replace some figures, each at its own examples per device, every size's
    row is still the one that size gets priced alone, bit for bit."""
    from test_device_table import _measured

    compared = measured = 0
    for seed in range(6):
        problem = random_problem(np.random.default_rng(seed))
        problem = replace(problem, measured_layers=_measured(problem))
        together, alone = StageCosts(problem), StageCosts(problem)
        stages = list(_stages(problem))
        for (cfg, b), got in zip(stages, together.layer_times_of(together.times_key(c, n) for c, n in stages)):
            key_cfg, key_b = alone.times_key(cfg, b)
            for a, want in zip(got, alone._layer_times_rows(key_cfg, [key_b])[0]):
                assert a.tobytes() == want.tobytes()
            compared += 1
            measured += bool(alone.measured(cfg, b / cfg.dp))
    assert compared > 50 and measured > 10

def test_range_sums_are_each_stages_own():
    """`StageCosts._ranges` sums per range once per times key and shard: each stage's are
    its own `per_layer`'s, summed (as before they were shared)."""
    from solver.cost.ranges import cumsum, span

    problems = []
    for costs, cfg, b in _priced_stages(10):
        problems += [costs] if not problems or problems[-1] is not costs else []
        layer = costs.per_layer(cfg, b)
        want = (span(cumsum(layer.forward)), span(cumsum(layer.backward)), span(cumsum(layer.saved)),
                costs._grads(cfg.tp), span(cumsum(layer.rerun)))
        for got, w in zip(costs._ranges(cfg, b), want):
            assert got.tobytes() == w.tobytes()
    assert sum(c._time_spans.cache_info().currsize < c._ranges.cache_info().currsize for c in problems) > 3

"""Stage pairs alike on the link share their sends (`solver.cost.cut_sends`): each pair's
figures are its own, bit for bit, as priced pair by pair before (`own_sends` below, that
code), on shared hosts too, where a measured copy replaces the link's time; and so is the
least over a pair's cuts between layers (`StageCosts.least_sends`, the planner's bounds')."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from solver.cost.measured import LayerPoint, MeasuredLayer
from solver.cost.stage_costs import StageCosts
from test_device_table import _same
from test_planner import random_problem
from test_stage_cost_sharing import _stages

INF = float("inf")


def own_sends(costs: StageCosts, a, c, b: int) -> np.ndarray:  # noqa: ANN001
    """One pair's sends, priced alone (the way before they were shared)."""
    streams = min(a.dp, c.dp)
    per_node = max(1, costs.kinds[a.kind].devices_per_node // a.tp)
    link = costs.problem.link(a.kind, c.kind).per_flow(min(streams, per_node))
    out = link.latency + costs.inputs * b / streams / link.bandwidth
    if costs.kinds[a.kind].shared_host and costs.kinds[c.kind].shared_host:
        for layer, price in costs.measured(c, b / c.dp).items():
            if price.send_s > 0:
                out[layer] = price.send_s
    return np.concatenate([out, [INF]])


def _shared_host(problem):  # noqa: ANN001, ANN202
    """Every kind one host's cores, layer 0 measured with a send on the first kind."""
    kinds = tuple(replace(k, shared_host=True) for k in problem.kinds)
    points = (LayerPoint(1, 0.01, 0.03, send_s=0.004), LayerPoint(8, 0.04, 0.12, send_s=0.02))
    measured = tuple(MeasuredLayer(kinds[0].name, 0, tp, dp, points, shared_host=True) for tp in (1, 2, 4) for dp in (1, 2, 4, 8))
    return replace(problem, kinds=kinds, measured_layers=measured)


def test_each_pairs_sends_are_its_own():
    compared = shared = measured = 0
    for seed in range(10):
        problem = random_problem(np.random.default_rng(seed))
        for p in (problem, _shared_host(problem)):
            costs = StageCosts(p)
            stages = list(_stages(p))[:12]
            for a, b in stages:
                for c, _ in stages:
                    got, want = costs.sends(a, c, b), own_sends(costs, a, c, b)
                    assert _same(got, want) and not got.flags.writeable
                    compared += 1
                    measured += bool(p.measured_layers) and got[0] != own_sends(StageCosts(problem), a, c, b)[0]
            shared += len({id(costs.sends(a, c, b)) for a, b in stages for c, _ in stages}) < len(stages) ** 2
            for b in {b for _, b in stages}:  # every pair's least over its cuts between layers, at once
                configs = [a for a, _ in stages]
                assert costs.least_sends(configs, b).tolist() == [
                    [float(own_sends(costs, a, c, b)[1:costs.n].min()) if costs.n > 1 else 0.0 for c in configs] for a in configs]
    assert compared > 500 and shared > 5 and measured > 10

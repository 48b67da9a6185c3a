"""Pricing hand-fixed configurations and the size-dependent matmul rate (solver only)."""

import pytest

from solver.collectives import LinkCost
from solver.efficiency import matmul_rate
from solver.planner import DeviceKind, LayerCost, PlanningError, Problem
from solver.planner.manual import ManualConfig, even_cuts, price
from solver.cost.stage_costs import StageConfig, StageCosts
from solver.planner.step import closed_form_step_s, simulated_step_s

LINK = LinkCost(1e10, 1e-5)


def _problem(batch=16, half_flops=0.0, matmuls=0.0, layers=6):
    layer = LayerCost(flops=3e9, forward_flops=1e9, param_bytes=1_000_000, saved_bytes=1e5, input_bytes=1e4, tp_bytes=2e4,
                      matmuls=matmuls)
    kind = DeviceKind("K", 8, 4, 1e12, 16 * 2**30, 1e12, LinkCost(1e11, 1e-6), LINK, matmul_half_flops=half_flops)
    return Problem((layer,) * layers, (kind,), batch)


def test_parse_reads_every_field_and_refuses_bad_text():
    c = ManualConfig.parse("tp=2, pp=4, dp=1, mb=2, schedule=interleaved, remat=full, kind=K")
    assert (c.tp, c.pp, c.dp, c.microbatch, c.schedule, c.chunks, c.remat, c.kind) == (2, 4, 1, 2, "interleaved", 2, True, "K")
    for bad, words in (("tp=2,pp=2", "needs dp"), ("tp=0,pp=1,dp=1", "positive whole number"), ("tp=1,pp=1,dp=1,zz=3", "key=value"),
                       ("tp=1,pp=1,dp=1,remat=maybe", "remat is 'full' or 'none'")):
        with pytest.raises(PlanningError, match=words):
            ManualConfig.parse(bad)


def test_even_cuts_give_the_extra_layers_to_the_first_stages():
    assert even_cuts(70, 12) == (6, 12, 18, 24, 30, 36, 42, 48, 54, 60, 65)
    assert even_cuts(6, 3) == (2, 4)


def test_a_manual_plan_is_priced_by_the_planners_model_and_simulated():
    problem = _problem()
    choice = price(problem, ManualConfig(tp=1, pp=2, dp=2, microbatch=2))
    assert choice.num_microbatches == 16 // (2 * 2)
    assert [(s.layer_start, s.layer_end, s.dp, s.tp) for s in choice.stages] == [(0, 3, 2, 1), (3, 6, 2, 1)]
    costs = StageCosts(problem)
    per = costs.per_layer(StageConfig("K", 2, 1), 4)
    assert choice.stages[0].forward_s == pytest.approx(float(per.forward[:3].sum()))
    assert choice.step_s == pytest.approx(simulated_step_s(choice)) and choice.step_s > 0
    remat = price(problem, ManualConfig(tp=1, pp=2, dp=2, microbatch=2, remat=True))
    assert all(s.remat for s in remat.stages)
    assert remat.stages[0].backward_s == pytest.approx(choice.stages[0].backward_s + choice.stages[0].forward_s)
    interleaved = price(problem, ManualConfig(tp=1, pp=2, dp=2, microbatch=2, schedule="interleaved", chunks=3))
    assert len(interleaved.stages) == 6 and interleaved.chunks == 3
    assert interleaved.step_s == pytest.approx(simulated_step_s(interleaved))
    assert closed_form_step_s(interleaved) > 0


def test_a_manual_plan_that_cannot_run_says_why():
    problem = _problem()
    for config, words in ((ManualConfig(tp=1, pp=4, dp=4), "needs 16 K devices"),
                          (ManualConfig(tp=8, pp=1, dp=1), "must divide the 4 devices"),
                          (ManualConfig(tp=1, pp=1, dp=3), "not a whole number of microbatches"),
                          (ManualConfig(tp=1, pp=2, dp=1, kind="X"), "no device kind 'X'"),
                          (ManualConfig(tp=1, pp=2, dp=1, schedule="interleaved", chunks=1), "at least 2 chunks")):
        with pytest.raises(PlanningError, match=words):
            price(problem, config)
    small = Problem(problem.layers, (DeviceKind("K", 8, 4, 1e12, 2**20, 1e12, LINK, LINK),), 16)
    with pytest.raises(PlanningError, match="does not fit"):
        price(small, ManualConfig(tp=1, pp=2, dp=1))


def test_matmul_rate_saturates_with_size():
    assert matmul_rate(100.0, 5.0, 5.0) == pytest.approx(50.0)
    assert matmul_rate(100.0, 0.0, 5.0) == 100.0 and matmul_rate(100.0, 7.0, 0.0) == 100.0
    rates = matmul_rate(100.0, [1.0, 10.0, 1e6], 10.0)
    assert list(rates) == sorted(rates) and rates[-1] == pytest.approx(100.0, rel=1e-4)


def test_small_matmuls_make_layers_slower_in_the_planner():
    flat = StageCosts(_problem()).per_layer(StageConfig("K", 1, 1), 1)
    curve = StageCosts(_problem(half_flops=1e8, matmuls=4)).per_layer(StageConfig("K", 1, 1), 1)
    # one example: matmuls of 1e9 / 4 = 2.5e8 FLOPs run at 2.5 / 3.5 of the rate
    assert curve.forward[0] == pytest.approx(flat.forward[0] * 3.5 / 2.5, rel=1e-9)
    tp = StageCosts(_problem(half_flops=1e8, matmuls=4)).per_layer(StageConfig("K", 1, 4), 1)
    assert tp.forward[0] > curve.forward[0] / 4  # tensor parallelism shrinks each matmul: less than a 4x speedup

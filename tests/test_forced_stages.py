"""A stage count fixed by hand fixes only that: the layers are cut as finely as the
planner's, so faster devices take more of them, and (offline, without a microbatch
count) the microbatch count is the estimator's fastest that fits."""

from __future__ import annotations

import hetpar
from hetpar.cluster.cluster import Cluster
from hetpar.plan.costs import estimate_plan
from models import gpt


def test_forced_stages_balance_layers_by_speed():
    w = gpt.setup(batch_size=8)
    cluster = Cluster.virtual({"A100": 4, "V100": 4})
    plan = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_microbatches=None, num_stages=4)
    even = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_microbatches=plan.num_microbatches, num_stages=4,
                            num_layers=4)  # the old default: one layer per stage
    a100 = sum(s.num_layers for s in plan.stages if s.device_type == "A100")
    v100 = sum(s.num_layers for s in plan.stages if s.device_type == "V100")
    assert plan.num_layers > 4 and a100 > v100
    assert plan.predicted_step_time_s < even.predicted_step_time_s


def test_forced_stages_take_the_fastest_microbatch_count_that_fits():
    w = gpt.setup(batch_size=8)
    cluster = Cluster.virtual({"A100": 4, "V100": 4})
    plan = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_microbatches=None, num_stages=2)
    for m in (1, 2):  # 4 would leave a 4-way data axis 2 examples: it cannot run
        fixed = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_microbatches=m, num_stages=2)
        assert estimate_plan(plan).step_s <= estimate_plan(fixed).step_s * (1 + 1e-12)

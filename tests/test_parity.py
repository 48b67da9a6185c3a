"""Correctness is parity: every plan computes what jax.jit(step) computes on one device."""

import pytest

import hetpar
from models import gpt, mlp
from parity import run_parity

TWO_TYPES = {"A100": 4, "V100": 4}
THREE_TYPES = {"H100": 2, "A100": 2, "V100": 4}
FAST_SLOW = {"H100": 4, "V100": 4}


@pytest.fixture(scope="module")
def mlp_workload():
    return mlp.setup(batch_size=16, depth=4)


@pytest.fixture(scope="module")
def gpt_workload():
    return gpt.setup(batch_size=16)


PLANS = [
    # (cluster, stages, microbatches, layers)
    (TWO_TYPES, 1, 1, None),
    (TWO_TYPES, 1, 4, None),
    (TWO_TYPES, 2, 1, None),
    (TWO_TYPES, 2, 2, 4),
    (TWO_TYPES, 2, 8, 4),
    (TWO_TYPES, 4, 4, 4),
    (THREE_TYPES, 3, 2, 4),
    (THREE_TYPES, 3, 8, None),
    (FAST_SLOW, 2, 4, 4),
]


def _id(plan):
    cluster, stages, mbs, layers = plan
    return f"{'+'.join(cluster)}-s{stages}-mb{mbs}-l{layers}"


@pytest.mark.parametrize("plan", PLANS, ids=_id)
def test_mlp_parity(mlp_workload, plan):
    counts, stages, mbs, layers = plan
    used = run_parity(mlp_workload, hetpar.Cluster.virtual(counts), num_stages=stages, num_microbatches=mbs, num_layers=layers)
    assert used.num_stages == stages
    assert used.num_microbatches == mbs


@pytest.mark.parametrize("plan", PLANS, ids=_id)
def test_gpt_parity(gpt_workload, plan):
    counts, stages, mbs, layers = plan
    used = run_parity(gpt_workload, hetpar.Cluster.virtual(counts), num_stages=stages, num_microbatches=mbs, num_layers=layers)
    assert used.num_stages == stages


ONE_F_ONE_B = [
    (TWO_TYPES, 2, 4, 4),
    (TWO_TYPES, 4, 8, 4),
    (THREE_TYPES, 3, 8, 4),
    (FAST_SLOW, 2, 2, 4),
]


@pytest.mark.parametrize("plan", ONE_F_ONE_B, ids=_id)
def test_one_f_one_b_parity(gpt_workload, mlp_workload, plan):
    counts, stages, mbs, layers = plan
    for workload in (gpt_workload, mlp_workload):
        used = run_parity(
            workload, hetpar.Cluster.virtual(counts), num_stages=stages, num_microbatches=mbs, num_layers=layers, schedule="1f1b"
        )
        assert used.schedule == "1f1b" and used.num_stages == stages


REPLICATED = [
    # (cluster, replicas, stages per replica, microbatches, layers, schedule)
    (FAST_SLOW, 2, 1, 2, None, "gpipe"),  # non-uniform: the H100 replica takes more examples
    (TWO_TYPES, 2, 2, 2, 4, "1f1b"),
    (THREE_TYPES, 3, 2, 2, 4, "1f1b"),
    ({"A100": 8}, 2, 2, 2, 4, "gpipe"),  # one type: a uniform split
]


def _rid(case):
    counts, replicas, stages, mbs, layers, schedule = case
    return f"{'+'.join(counts)}-r{replicas}-s{stages}-mb{mbs}-{schedule}"


@pytest.mark.parametrize("case", REPLICATED, ids=_rid)
def test_data_parallel_replicas_parity(gpt_workload, mlp_workload, case):
    counts, replicas, stages, mbs, layers, schedule = case
    for workload in (gpt_workload, mlp_workload):
        plan = run_parity(
            workload, hetpar.Cluster.virtual(counts), num_replicas=replicas, num_stages=stages,
            num_microbatches=mbs, num_layers=layers, schedule=schedule,
        )
        assert plan.num_replicas == replicas and sum(plan.replica_batch) == 16
    if len(counts) == 1:
        assert len(set(plan.replica_batch)) == 1
    else:  # faster replicas take more of the batch
        speeds = [sum(s.speed_flops for s in plan.replica_stages(r)) for r in range(replicas)]
        share = plan.replica_batch
        assert all(share[i] >= share[j] for i in range(replicas) for j in range(replicas) if speeds[i] > speeds[j])
        assert len(set(share)) > 1


def test_faster_type_gets_more_layers(gpt_workload):
    plan = run_parity(gpt_workload, hetpar.Cluster.virtual(FAST_SLOW), num_stages=2, num_microbatches=2, num_layers=4)
    h100, v100 = plan.stages
    assert (h100.device_type, v100.device_type) == ("H100", "V100")
    assert h100.num_layers > v100.num_layers


def test_stages_follow_given_device_order(mlp_workload):
    plan = run_parity(mlp_workload, hetpar.Cluster.virtual({"V100": 4, "H100": 4}), num_stages=2, num_microbatches=2, num_layers=4)
    assert [s.device_type for s in plan.stages] == ["V100", "H100"]
    assert plan.stages[1].num_layers > plan.stages[0].num_layers


PLANNER_CASES = [
    # (cluster, microbatches, schedule): the planner picks stages, devices, layers and replicas
    (TWO_TYPES, 1, None),
    (TWO_TYPES, 4, None),
    (THREE_TYPES, 2, None),
    (THREE_TYPES, 4, "gpipe"),
    (FAST_SLOW, 2, "1f1b"),
]


@pytest.mark.parametrize("case", PLANNER_CASES, ids=lambda c: f"{'+'.join(c[0])}-mb{c[1]}-{c[2] or 'any'}")
def test_planner_plans_parity(gpt_workload, mlp_workload, case):
    counts, microbatches, schedule = case
    for workload in (mlp_workload, gpt_workload):
        plan = run_parity(workload, hetpar.Cluster.virtual(counts), num_microbatches=microbatches, schedule=schedule)
        assert plan.bound_ratio is not None  # made by the planner
        assert plan.schedule == (schedule or plan.schedule)
        for s in plan.stages:
            assert s.memory_bytes <= s.memory_capacity

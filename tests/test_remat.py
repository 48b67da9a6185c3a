"""Recomputation really runs: a stage marked `remat` keeps fewer activations between
its forward and backward programs, recomputes them in the backward, and the step
still computes what jax.jit(step) computes."""

import pytest

import hetpar
from hetpar.compile.step import step_tasks
from hetpar.options import StageOption
from hetpar.trace.microbatch import Phase
from hetpar.trace.traced_step import trace_step
from models import gpt
from parity import run_parity, with_grads

TWO_TYPES = {"A100": 4, "V100": 4}


@pytest.fixture(scope="module")
def gpt_workload():
    return gpt.setup(batch_size=8)


CASES = [  # (policy, schedule, stages, microbatches)
    ("full", "gpipe", 2, 2),
    ("dots", "gpipe", 2, 2),
    ("full", "1f1b", 3, 4),
    ("dots", "1f1b", 2, 4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_recomputing_stages_parity(gpt_workload, case):
    policy, schedule, stages, mbs = case
    plan = run_parity(gpt_workload, hetpar.Cluster.virtual(TWO_TYPES), steps=2, num_stages=stages, num_microbatches=mbs,
                      num_layers=4, schedule=schedule, stage_option=StageOption(remat=policy))
    assert {s.device_type for s in plan.stages} == {"A100", "V100"}
    assert all(s.remat == policy for s in plan.stages)


def _tasks(workload, policy):
    step = with_grads(workload.loss_fn)
    args = (workload.state, workload.batch)
    plan = hetpar.make_plan(step, args, hetpar.Cluster.virtual(TWO_TYPES), num_microbatches=2, num_stages=2, num_layers=4,
                            stage_option=StageOption(remat=policy) if policy else None)
    traced = trace_step(step, args, 1, 2)
    return {(t.kind, t.stage): t for t in step_tasks(traced, plan).tasks}, traced


def test_recomputation_moves_forward_work_into_the_backward(gpt_workload):
    """Without recomputation the first stage's forward hands its backward many
    activations; with "full" only what the next stage needs leaves it, and the
    backward reruns forward operators; "dots" keeps the weight matmuls' results."""
    kept, traced = _tasks(gpt_workload, "")
    full, _ = _tasks(gpt_workload, "full")
    dots, _ = _tasks(gpt_workload, "dots")
    graph = traced.full
    # The per-microbatch forward's own operators (not the small once-per-step values
    # both programs remake from the step's inputs: compile/remade.py).
    fwd_ops = {i for i in kept["fwd", 0].ops if traced.analysis.phase[i] is Phase.MICRO}
    assert not fwd_ops & set(kept["bwd", 0].ops)
    assert len(full["fwd", 0].outputs) < len(dots["fwd", 0].outputs) < len(kept["fwd", 0].outputs)
    redone_full = fwd_ops & set(full["bwd", 0].ops)
    redone_dots = fwd_ops & set(dots["bwd", 0].ops)
    assert redone_dots < redone_full
    names = lambda ops: {graph.ops[i].name for i in ops}  # noqa: E731
    assert "dot_general" in names(redone_full)
    saved = set(kept["fwd", 0].ops) - redone_dots
    assert any(graph.ops[i].name == "dot_general" for i in saved)

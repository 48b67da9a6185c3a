"""Small values made from the step's inputs alone are remade where they are read
(compile/remade.py): a two-stage GPT step under Adam dispatches no "pre" program and
no second update phase, and still computes what jax.jit computes."""

import jax
import pytest

import hetpar
from hetpar.compile.remade import SMALL, remakeable
from hetpar.trace.microbatch import Phase
from models import gpt
from parity import assert_close, with_grads

TWO_TYPES = {"A100": 4, "V100": 4}


@pytest.fixture(scope="module")
def workload():
    return gpt.setup(batch_size=8)


def test_two_stage_step_has_one_program_per_microbatch_and_stage(workload):
    step = with_grads(workload.loss_fn)
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, num_microbatches=4,
                                  num_layers=4, schedule="1f1b")
    ref_state = par_state = workload.state
    reference = jax.jit(step)
    for i in range(2):
        ref_state, *ref_out = reference(ref_state, workload.batch)
        par_state, *par_out = parallel(par_state, workload.batch)
        assert_close(par_out, ref_out, f"loss and gradients, step {i}")
        assert_close(par_state.params, ref_state.params, f"parameters after step {i}")
        assert_close(par_state.opt_state, ref_state.opt_state, f"optimizer state after step {i}")
    compiled = parallel.compiled()
    kinds = [(t.kind, t.stage, t.phase) for t in compiled.tasks]
    # The mask, position ids and bias reshapes are remade by the programs that read
    # them; Adam's step count and bias corrections by each stage's update.
    assert not [k for k in kinds if k[0] == "pre"], kinds
    assert sorted(k for k in kinds if k[0] == "post") == [("post", 0, 0), ("post", 1, 0)]
    # Each stage's update runs inside its last microbatch: 4 microbatches on each of the
    # first stage's forward and backward and the last stage's forward, nothing else.
    dispatched = [s for s in compiled.order if not s.combine]
    assert len(dispatched) == 12 and sum(s.fused is not None for s in dispatched) == 2


def test_only_small_values_of_the_step_inputs_are_remade(workload):
    from hetpar.trace.traced_step import trace_step

    traced = trace_step(workload.step, (workload.state, workload.batch), 1, 2)
    graph, analysis = traced.full, traced.analysis
    free = remakeable(graph, analysis)
    assert free  # the causal mask, Adam's bias corrections
    made = set()
    for i in sorted(free):
        op = graph.ops[i]
        assert analysis.phase[i] is not Phase.MICRO
        assert all(v not in graph.producer or v in made for v in op.inputs)  # step inputs and other remade values only
        assert all(graph.avals[v].size <= SMALL and v not in analysis.batch_axis for v in op.outputs)
        made.update(op.outputs)
    # The optimizer's update of a parameter reads its gradient: it is never remade.
    assert not any(analysis.phase[i] is Phase.POST and any(v in analysis.reductions for v in graph.ops[i].inputs)
                   for i in free)

"""Each stage's optimizer update runs inside the program of its last microbatch's
backward: one dispatch fewer per stage, and the gradients never come back to the
runtime between the backward and the update. Same numbers as jax.jit; where the
update must wait for other pipelines' gradients (data-parallel replicas) it stays a
program of its own."""

import re
from collections import Counter

import jax
import pytest

import hetpar
from models import mlp
from parity import assert_close, with_grads

TWO_TYPES = {"A100": 4, "V100": 4}


def _steps_match_jit(parallel, reference, w, steps: int = 2) -> None:
    par_state = ref_state = w.state
    for i in range(steps):
        ref_state, *ref_out = reference(ref_state, w.batch)
        par_state, *par_out = parallel(par_state, w.batch)
        assert_close(par_out, ref_out, f"outputs, step {i}")
        assert_close(par_state.params, ref_state.params, f"parameters after step {i}")
        assert_close(par_state.opt_state, ref_state.opt_state, f"optimizer state after step {i}")


@pytest.mark.parametrize("stages, microbatches, returns_grads", [(2, 4, True), (1, 1, False)])
def test_each_stage_update_is_fused_into_its_last_backward(stages, microbatches, returns_grads):
    w = mlp.setup(batch_size=16, depth=4)
    step = with_grads(w.loss_fn) if returns_grads else w.step
    counts = TWO_TYPES if stages == 2 else {"A100": 8}
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(counts), num_stages=stages,
                                  num_microbatches=microbatches, num_layers=4, schedule="1f1b")
    _steps_match_jit(parallel, jax.jit(step), w)
    compiled = parallel.compiled()
    posts = {i for i, p in enumerate(compiled.programs) if p.task.kind == "post" and p.task.phase == 0}
    # Every stage's update is folded into the host program of that stage, and only
    # there: its last microbatch, not the others.
    assert set(compiled.fused_posts.values()) == posts and len(posts) == stages
    for host, post in compiled.fused_posts.items():
        assert compiled.programs[host].task.stage == compiled.programs[post].task.stage
        assert compiled.programs[host].task.kind == ("bwd" if compiled.programs[host].task.stage < stages - 1 else "fwd")
    fused_steps = [s for s in compiled.order if s.fused is not None]
    assert len(fused_steps) == stages and all(s.microbatch == microbatches - 1 for s in fused_steps)
    assert not [s for s in compiled.order if s.program in posts]  # no separate update dispatch
    # With one microbatch the stage's pre work runs inside that program too: the
    # one-stage step is one dispatch, as with jax.jit.
    dispatched = [compiled.programs[s.program].task.kind for s in compiled.order if not s.combine]
    pres = {i for i, p in enumerate(compiled.programs) if p.task.kind == "pre"}
    if microbatches == 1:
        assert dispatched == ["fwd"] * stages and compiled.folded_pres == pres
    else:
        assert not compiled.folded_pres
    # With one microbatch there is nothing to accumulate into: no accumulator argument.
    assert all(f.accumulates == (microbatches > 1) for f in compiled.fused.values())
    # Data-parallel stages reduce their gradients over `data` once per step: a
    # microbatch's program all-reduces nothing; the last (with the update) all-reduces
    # exactly the stage's reductions, each once. With several microbatches that takes
    # per-shard partial sums kept across them; with one, XLA's own partitioning.
    for host, fused in compiled.fused.items():
        program = compiled.programs[host]
        assert dict(program.mesh.shape) == {"data": 4 if stages == 2 else 8}  # the premise: data parallel only
        if microbatches > 1:
            assert program.stacked == set(program.task.reductions) and program.stacked
        else:
            assert not program.stacked
        if microbatches > 1:
            assert not _all_reduced(program.lower().compile().as_text()), "a microbatch's program all-reduces"
        reductions = Counter(_type(compiled.graph.avals[v]) for v in program.task.reductions)
        assert Counter(_all_reduced(fused.lower().compile().as_text())) == reductions


def _type(aval) -> str:
    return f"{aval.dtype}[{','.join(map(str, aval.shape))}]".replace("float32", "f32")


def _all_reduced(hlo: str) -> list[str]:
    """The result types of every all-reduce (a tuple-typed one gives each)."""
    return [t for result in re.findall(r"= (.+?) all-reduce(?:-start)?\(", hlo) for t in re.findall(r"\w+\[[\d,]*\]", result)]


def test_replicas_keep_the_update_apart():
    w = mlp.setup(batch_size=16, depth=4)
    step = with_grads(w.loss_fn)
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=1, num_replicas=2,
                                  num_microbatches=2, num_layers=4)
    _steps_match_jit(parallel, jax.jit(step), w, steps=1)
    compiled = parallel.compiled()
    assert compiled.num_replicas == 2 and not compiled.fused
    assert any(compiled.programs[s.program].task.kind == "post" for s in compiled.order if not s.combine)

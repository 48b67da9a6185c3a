"""The plan is the contract: compile reads a plan and nothing else. A saved plan,
loaded in a fresh process whose solvers all raise, compiles to exactly the programs
the solving process compiled (same StableHLO text) and computes the same numbers."""

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

import hetpar
from hetpar.errors import PlanError
from hetpar.plan.file import plan_to_dict, save_plan
from models import gpt
from parity import assert_close, with_grads

ROOT = Path(__file__).resolve().parent.parent
CONFIG = dict(d_model=128, n_heads=4, n_layers=2)

# Run in a fresh interpreter: every solver and the layer builder raise, so compiling
# the plan can only succeed if it asks none of them.
_LOAD_AND_COMPILE = textwrap.dedent("""
    import hashlib, json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, "tests")
    import hetpar, hetpar.api, hetpar.shard, hetpar.pipeline, solver.intra_op, solver.planner.search
    from models import gpt
    from parity import with_grads

    def refuse(*args, **kwargs):
        raise AssertionError("compile called a solver")

    for module, name in [(hetpar.api, "solve"), (hetpar.pipeline, "build_layers"), (hetpar.shard, "solve_intra_op"),
                         (solver.intra_op, "solve_intra_op")]:
        setattr(module, name, refuse)
    solver.planner.search.Planner.solve = refuse

    w = gpt.setup(batch_size=8, config=gpt.GPTConfig(**json.loads(sys.argv[2])))
    step = hetpar.parallelize(with_grads(w.loss_fn), plan=sys.argv[1])
    _, loss, _ = step(w.state, w.batch)
    compiled = step.compiled()
    print(json.dumps({"loss": float(loss), "programs": [hashlib.sha256(p.lower().as_text().encode()).hexdigest()
                                                        for p in [*compiled.programs, *compiled.fused.values()]]}))
""")


def _digests(step: hetpar.ParallelFunction) -> list[str]:
    """Every program the step dispatches, the fused last-microbatch-and-update ones included."""
    compiled = step.compiled()
    assert compiled.fused, "each stage's update runs fused into its last backward"
    return [hashlib.sha256(p.lower().as_text().encode()).hexdigest() for p in [*compiled.programs, *compiled.fused.values()]]


@pytest.fixture(scope="module")
def solved(tmp_path_factory):
    """A two-stage plan on two device types, each stage a 2x2 mesh sharded by the ILP."""
    w = gpt.setup(batch_size=8, config=gpt.GPTConfig(**CONFIG))
    step = hetpar.parallelize(with_grads(w.loss_fn), cluster=hetpar.Cluster.virtual({"A100": 4, "V100": 4}),
                              num_stages=2, num_microbatches=2, mesh_shape=(2, 2), schedule="1f1b")
    _, loss, _ = step(w.state, w.batch)
    path = tmp_path_factory.mktemp("contract") / "plan.json"
    save_plan(step.plan, path)
    return w, step, float(loss), path


def test_the_plan_holds_operator_stages_and_shardings(solved):
    _, step, _, path = solved
    plan = step.plan
    assert len(plan.operator_stages) == 1 and sum(n for _, n in plan.operator_stages[0]) == plan.program.num_operators
    assert {s for s, _ in plan.operator_stages[0]} == {0, 1}
    assert all(s.shardings for s in plan.stages)  # every 2x2 stage records what the ILP chose
    raw = json.loads(path.read_text())
    assert raw["stages"][0]["shardings"] and raw["operator_stages"]
    # Parameters' specs are structured data, not text for people only.
    assert all(isinstance(spec, tuple) for s in plan.stages for _, spec in s.param_specs)


def test_a_saved_plan_compiles_to_the_same_programs_in_a_fresh_process_without_solving(solved):
    _, step, loss, path = solved
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_COMPILE, str(path), json.dumps(CONFIG)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["programs"] == _digests(step)
    assert loaded["loss"] == pytest.approx(loss, rel=1e-6)


def test_compiling_a_plan_asks_no_solver_in_process(solved, monkeypatch):
    w, step, _, path = solved

    def refuse(*args, **kwargs):
        raise AssertionError("compile called a solver")

    import hetpar.api
    import hetpar.shard
    import hetpar.pipeline

    for module, name in [(hetpar.api, "solve"), (hetpar.pipeline, "build_layers"), (hetpar.shard, "solve_intra_op")]:
        monkeypatch.setattr(module, name, refuse)
    loaded = hetpar.parallelize(with_grads(w.loss_fn), plan=str(path))
    new, loss, grads = loaded(w.state, w.batch)
    ref_new, ref_loss, ref_grads = jax.jit(with_grads(w.loss_fn))(w.state, w.batch)
    assert_close(loss, ref_loss, "loss")
    assert_close(grads, ref_grads, "gradients")
    assert_close(new.params, ref_new.params, "parameters")


def test_a_plan_whose_operator_stages_do_not_match_the_step_is_refused(solved, tmp_path):
    w, step, _, _ = solved
    raw = plan_to_dict(step.plan)
    raw["operator_stages"][0][-1][1] += 3  # three operators more than the step has
    raw["program"] = None  # even without the fingerprint, the count gives it away
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    loaded = hetpar.parallelize(with_grads(w.loss_fn), plan=str(bad))
    with pytest.raises(PlanError, match="operators"):
        loaded(w.state, w.batch)

"""3D tensor parallelism: a stage mesh of three axes (data x model x model2). The
sharding ILP may split a matmul over all three at once, Colossal-AI's 3D way (rows,
contraction and columns each on an axis, each operand over a pair of them), or over
fewer where that is cheaper; the step computes what `jax.jit` does on one device."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

import hetpar
from hetpar.errors import PlanError
from hetpar.plan.file import plan_from_dict, plan_to_dict
from hetpar.shard.strategies import dot_choices, stage_problem
from hetpar.trace.traced_step import trace_step
from models import mlp
from parity import run_parity
from solver.collectives import LinkCost
from solver.intra_op import solve_intra_op

MESH3 = {"data": 2, "model": 2, "model2": 2}
THREE = {"data", "model", "model2"}


def _matmul_chain(hidden: int = 256, tokens: int = 64, blocks: int = 2):
    """MLP blocks of square matmuls on a residual stream (benchmarks/tensor_3d.py's),
    traced on abstract shapes."""
    def step(weights, x):
        def loss(weights):
            h = x
            for w1, w2 in weights:
                h = h + jax.nn.relu(h @ w1) @ w2
            return jnp.mean(h * h)

        value, grads = jax.value_and_grad(loss)(weights)
        return jax.tree.map(lambda w, g: w - 0.1 * g, weights, grads), value

    square = jax.ShapeDtypeStruct((hidden, hidden), jnp.float32)
    weights = tuple((square, square) for _ in range(blocks))
    return trace_step(step, (weights, jax.ShapeDtypeStruct((tokens, hidden), jnp.float32)), 1, 1)


def test_a_matmul_on_three_axes_may_split_rows_contraction_and_columns_at_once():
    traced = _matmul_chain()
    graph = traced.full
    op = next(o for o in graph.ops if o.name == "dot_general")
    choices = dot_choices(op, graph.avals, MESH3)
    three = [c for c in choices if {a for a in c.lhs + c.rhs if a} == THREE]
    assert three, "no choice uses all three axes"
    for c in three:  # each operand over a pair of axes; the contraction's axis sums partials
        assert len({a for a in c.lhs if a}) == 2 and len({a for a in c.rhs if a}) == 2 and len(c.summed_over) == 1
    # ... beside the choices of fewer axes, and none on a mesh without the third
    assert any(len({a for a in c.lhs + c.rhs if a}) == 1 for c in choices)
    assert all("model2" not in c.lhs + c.rhs for c in dot_choices(op, graph.avals, {"data": 2, "model": 4}))


def _ilp(traced, mesh: dict[str, int], flops: float):
    graph = traced.full
    held = {v for v in graph.invars if v not in traced.analysis.batch_axis}
    problem = stage_problem(graph, list(range(len(graph.ops))), held, mesh, flops, LinkCost(300e9, 3e-6),
                            batch_axis=traced.analysis.batch_axis)
    solution = solve_intra_op(problem.problem)
    used = [{a for a in problem.choices[n][c].lhs + problem.choices[n][c].rhs if a} for n, c in enumerate(solution.choice)]
    return solution.cost_s, used


def test_the_ilp_takes_three_axes_where_they_are_cheaper_and_fewer_where_not():
    """Large matmuls on 64 devices: the 3D layouts beat the best on an 8 x 8 mesh.
    Tiny ones on 8: moving anything costs more than computing it, so the ILP leaves
    axes unused rather than split every matmul three ways."""
    large = _matmul_chain(hidden=16384, tokens=16384)
    cost3, used3 = _ilp(large, {"data": 4, "model": 4, "model2": 4}, 2e14)
    cost2, _ = _ilp(large, {"data": 8, "model": 8}, 2e14)
    assert any(u == THREE for u in used3) and cost3 < cost2
    tiny = _matmul_chain(hidden=16, tokens=8)
    _, used = _ilp(tiny, MESH3, 2e14)
    assert not any(u == THREE for u in used)


def test_a_2x2x2_mesh_computes_what_jax_jit_does():
    """Matmuls wide enough (on slow CPU devices) that splitting each over all three
    axes pays: the ILP does, and the step matches `jax.jit` on one device."""
    w = mlp.setup(batch_size=64, in_dim=512, hidden=1024, depth=2, out_dim=512)
    plan = run_parity(w, hetpar.Cluster.virtual({"cpu": 8}), num_stages=1, mesh_shape=(2, 2, 2), num_microbatches=1)
    stage = plan.stages[0]
    assert stage.mesh_shape == (2, 2, 2) and stage.data_parallel == 2 and stage.tensor_parallel == 4
    spans = [{a for a in lhs + rhs if a} for _, (lhs, rhs) in stage.operand_shardings]
    assert any(u == THREE for u in spans), stage.operand_shardings
    assert any("model2" in spec for _, spec in stage.param_specs)
    # The plan file keeps the third axis.
    again = plan_from_dict(json.loads(json.dumps(plan_to_dict(plan))))
    assert again.stages[0].mesh_shape == (2, 2, 2) and again.stages[0].operand_shardings == stage.operand_shardings


def test_mesh_shapes_of_more_than_three_axes_or_a_model2_on_two_are_refused():
    w = mlp.setup(batch_size=8, depth=2)
    cluster = hetpar.Cluster.virtual({"cpu": 8})
    with pytest.raises(PlanError, match=r"mesh_shape \(2, 2, 1, 2\) does not fit stage 0's 8 devices: give \(data, model\) "
                                        r"or \(data, model, model2\)"):
        hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_stages=1, num_layers=2, mesh_shape=(2, 2, 1, 2))
    plan = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_stages=1, num_layers=2, mesh_shape=(2, 4))
    raw = plan_to_dict(plan)
    raw["stages"][0]["shardings"] = [[0, ["model2"]]]
    with pytest.raises(PlanError, match=r"over this stage's axes \['data', 'model'\]"):
        plan_from_dict(raw)


def test_a_pipeline_of_a_3_axis_and_a_2_axis_stage_computes_what_jax_jit_does():
    """Values cross between a data x model x model2 mesh and a data x model one."""
    w = mlp.setup(batch_size=32, in_dim=256, hidden=512, depth=4, out_dim=256)
    plan = run_parity(w, hetpar.Cluster.virtual({"cpu": 8}), num_stages=2, mesh_shape=((1, 2, 2), (2, 2)),
                      num_microbatches=2, num_layers=4, schedule="1f1b")
    assert [s.mesh_shape for s in plan.stages] == [(1, 2, 2), (2, 2)]
    assert {"model", "model2"} <= {a for _, (lhs, rhs) in plan.stages[0].operand_shardings for a in lhs + rhs if a}

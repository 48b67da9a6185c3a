"""3D tensor parallelism: a stage mesh of three axes (data x model x model2). The
sharding ILP may split a matmul over all three at once, Colossal-AI's 3D way (rows,
contraction and columns each on an axis, each operand over a pair of them), or over
fewer where that is cheaper; the step computes what `jax.jit` does on one device.
Where the sharding pass chooses a stage's mesh, a model axis of 4 or more is also
tried as two (`hetpar.shard.model_axes`), and a stage on two model axes is priced by
the estimator from the collectives its layouts run."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import hetpar
from hetpar.cluster.catalog import device_type
from hetpar.errors import PlanError
from hetpar.pipeline import solve
from hetpar.plan.collectives import plan_collectives
from hetpar.plan.costs import estimate_plan
from hetpar.plan.file import plan_from_dict, plan_to_dict
from hetpar.shard.model_axes import choose_model_axes, factorings
from hetpar.shard.strategies import dot_choices, stage_problem
from hetpar.trace.traced_step import trace_step
from models import mlp
from parity import run_parity
from solver.collectives import LinkCost
from solver.cost.model_axes import ModelCollective
from solver.cost.stage_costs import StageConfig, StageCosts
from solver.intra_op import solve_intra_op

CLUSTERS = Path(__file__).resolve().parents[1] / "examples" / "clusters"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from agreement import max_rel_diff, view_figures  # noqa: E402

MESH3 = {"data": 2, "model": 2, "model2": 2}
THREE = {"data", "model", "model2"}


def _matmul_chain(hidden: int = 256, tokens: int = 64, blocks: int = 2, dtype=jnp.float32):
    """MLP blocks of square matmuls on a residual stream (benchmarks/tensor_3d.py's),
    traced on abstract shapes."""
    def step(weights, x):
        def loss(weights):
            h = x
            for w1, w2 in weights:
                h = h + jax.nn.relu(h @ w1) @ w2
            return jnp.mean(h * h)

        value, grads = jax.value_and_grad(loss)(weights)
        return jax.tree.map(lambda w, g: w - (0.1 * g).astype(w.dtype), weights, grads), value

    square = jax.ShapeDtypeStruct((hidden, hidden), dtype)
    weights = tuple((square, square) for _ in range(blocks))
    return trace_step(step, (weights, jax.ShapeDtypeStruct((tokens, hidden), dtype)), 1, 1)


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


# The chooser: a model axis of 4 or more laid out as one axis or two, as the ILP prices cheaper.


def _ilp_cost(traced, flops: float, link: LinkCost, half: float = 0.0):
    """`hetpar.shard.model_axes.choose_model_axes`'s price of a mesh: the stage's ILP
    cost on it, each mesh solved once."""
    graph = traced.full
    held = {v for v in graph.invars if v not in traced.analysis.batch_axis}
    solved = {}

    def cost_of(mesh: dict[str, int], beat: float) -> float:
        key = tuple(mesh.items())
        if key not in solved:
            problem = stage_problem(graph, list(range(len(graph.ops))), held, mesh, flops, link,
                                    batch_axis=traced.analysis.batch_axis, matmul_half_flops=half)
            solved[key] = solve_intra_op(problem.problem).cost_s
        return solved[key]

    return cost_of, solved


def test_the_chooser_factors_a_wide_model_axis_for_large_matmuls_and_not_for_narrow_ones():
    """64 A100s, square 16384-wide bf16 matmuls on a 4 x 16 mesh: the ILP prices the
    model axis as two (4 x 4 x 4 or 4 x 2 x 8) cheaper than one, and the chooser takes
    the cheapest it solved. A narrow model on the same mesh: one model axis stays."""
    spec = device_type("A100-80GB")
    link = LinkCost(spec.intra_node_link.bandwidth, spec.intra_node_link.latency)
    flops = spec.sustained_matmul_flops("bfloat16")
    large = _matmul_chain(hidden=16384, tokens=16384, dtype=jnp.bfloat16)
    cost_of, solved = _ilp_cost(large, flops, link, spec.matmul_half_flops)
    shape, cost = choose_model_axes((4, 16), cost_of)
    assert len(shape) == 3 and shape[0] == 4 and shape[1] * shape[2] == 16, shape
    assert set(solved) == {(("data", 4), ("model", 16)), (("data", 4), ("model", 2), ("model2", 8)),
                           (("data", 4), ("model", 4), ("model2", 4))}  # the mesh and its two factorings, once each
    assert cost == min(solved.values()) < solved[(("data", 4), ("model", 16))]
    narrow = _matmul_chain(hidden=64, tokens=64, dtype=jnp.bfloat16)
    cost_of, solved = _ilp_cost(narrow, flops, link, spec.matmul_half_flops)
    assert choose_model_axes((4, 16), cost_of)[0] == (4, 16)
    assert min(v for k, v in solved.items() if len(k) == 3) >= solved[(("data", 4), ("model", 16))]
    # Nothing to factor: a model axis under 4, or no model axis.
    assert factorings(4) == [(2, 2)] and factorings(16) == [(2, 8), (4, 4)] and factorings(3) == []
    assert choose_model_axes((8, 2), lambda mesh, beat: 1.0)[0] == (8, 2) and choose_model_axes((8,), lambda mesh, beat: 1.0)[0] == (8,)


def test_a_mesh_the_chooser_factored_computes_what_jax_jit_does_and_is_priced_from_its_layouts():
    """8 CPU devices labelled A100s, a (2, 4) mesh whose model axis the sharding pass
    may factor (`factor_model_axis`): for these 2048-wide matmuls on 1024 examples
    the ILP prices 2 x 2 x 2 cheaper and the estimator agrees (at 1024 wide on 512
    examples it does not, and the mesh stays 2 x 4), the plan says so, the step
    matches `jax.jit`, the estimator prices the stage from the collectives its
    layouts run (not Megatron's 4-way all-reduce), and the plan file keeps mesh and
    collectives."""
    w = mlp.setup(batch_size=1024, in_dim=2048, hidden=2048, depth=2, out_dim=2048)
    plan = run_parity(w, hetpar.Cluster.virtual({"A100": 8}), steps=2, num_stages=1, mesh_shape=(2, 4), num_microbatches=1,
                      sharding_option=hetpar.ShardingOption(factor_model_axis=True))
    stage = plan.stages[0]
    assert stage.mesh_shape == (2, 2, 2) and stage.data_parallel == 2 and stage.tensor_parallel == 4
    assert any({a for a in lhs + rhs if a} == THREE for _, (lhs, rhs) in stage.operand_shardings)
    # Priced from its layouts: the recorded collectives run over one axis of 2 devices each.
    assert stage.model_collectives and {c[3] for c in stage.model_collectives} == {2}
    costs = StageCosts(plan.cost_inputs)
    collectives = tuple(ModelCollective(*c) for c in stage.model_collectives)
    layer = costs.per_layer(StageConfig(stage.group, 2, 4, 0, collectives), 1024)
    span = slice(stage.layer_start, stage.layer_end)
    assert stage.forward_s == pytest.approx(layer.forward[span].sum(), rel=1e-9)
    assert stage.backward_s == pytest.approx(layer.backward[span].sum(), rel=1e-9)
    megatron = costs.per_layer(StageConfig(stage.group, 2, 4), 1024)
    assert stage.forward_s != pytest.approx(megatron.forward[span].sum(), rel=1e-6)
    uses = [u for u in plan_collectives(plan) if u.purpose.startswith("tensor-parallel")]
    assert uses and all(u.devices == 2 for u in uses)
    again = plan_from_dict(json.loads(json.dumps(plan_to_dict(plan))))
    assert again.stages[0].mesh_shape == (2, 2, 2) and again.stages[0].model_collectives == stage.model_collectives
    assert again.predicted_step_time_s == pytest.approx(plan.predicted_step_time_s, rel=1e-12)


def test_the_chooser_keeps_one_model_axis_where_the_estimator_prices_two_slower():
    """1024-wide matmuls on 512 examples: the ILP prices 2 x 2 x 2 a hair cheaper
    than 2 x 4, but the whole step, as the estimator prices it with each mesh's own
    collectives, is slower on it, so the plan keeps 2 x 4."""
    w = mlp.setup(batch_size=512, in_dim=1024, hidden=1024, depth=2, out_dim=1024)
    cluster = hetpar.Cluster.virtual({"A100": 8})
    kept = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_stages=1, mesh_shape=(2, 4), num_microbatches=1,
                            sharding_option=hetpar.ShardingOption(factor_model_axis=True))
    assert kept.stages[0].mesh_shape == (2, 4)
    forced = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_stages=1, mesh_shape=(2, 2, 2), num_microbatches=1)
    assert forced.predicted_step_time_s > kept.predicted_step_time_s


def test_without_factor_model_axis_a_mesh_given_by_hand_stands():
    w = mlp.setup(batch_size=512, in_dim=1024, hidden=1024, depth=2, out_dim=1024)
    cluster = hetpar.Cluster.virtual({"A100": 8})
    plan = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_stages=1, mesh_shape=(2, 4), num_microbatches=1)
    assert plan.stages[0].mesh_shape == (2, 4) and not plan.stages[0].model_collectives
    small = mlp.setup(batch_size=16, in_dim=16, hidden=32, depth=2, out_dim=8)  # too narrow to gain from two model axes
    plan = hetpar.make_plan(small.step, (small.state, small.batch), cluster, num_stages=1, mesh_shape=(2, 4), num_microbatches=1,
                            sharding_option=hetpar.ShardingOption(factor_model_axis=True))
    assert plan.stages[0].mesh_shape == (2, 4)


def test_the_planning_passes_choose_three_axes_for_large_matmuls_on_64_devices():
    """Planned end to end (planner, then the sharding pass choosing each stage's mesh):
    16384-wide bf16 matmuls on 64 A100s get stages on 3-axis meshes, priced from the
    collectives their layouts run; a narrow model on the same cluster gets none."""
    cluster = hetpar.Cluster.from_file(str(CLUSTERS / "a100_64.yaml")).numbered()
    plan = solve(_matmul_chain(hidden=16384, tokens=16384, dtype=jnp.bfloat16), cluster)
    three = [s for s in plan.stages if len(s.mesh_shape) == 3]
    assert three, [s.mesh_shape for s in plan.stages]
    for s in three:
        assert s.model_collectives and s.tensor_parallel == s.mesh_shape[1] * s.mesh_shape[2] >= 4
    priced_as_megatron = estimate_plan(replace(plan, stages=tuple(replace(s, model_collectives=()) for s in plan.stages)))
    assert plan.predicted_step_time_s == pytest.approx(estimate_plan(plan).step_s, rel=1e-12)
    assert plan.predicted_step_time_s != pytest.approx(priced_as_megatron.step_s, rel=1e-9)
    # Every view (solve, show from the saved file, simulate, the API, compare, by hand) prints that price.
    figures = view_figures(plan)
    assert {"solve", "show", "simulate", "api", "compare", "by hand"} <= set(figures)
    assert max_rel_diff(figures) <= 1e-9, figures
    raw = plan_to_dict(plan)  # a collective named for a layer the stage does not hold is refused
    raw["stages"][0]["model_collectives"][0][0] = plan.stages[0].layer_end
    with pytest.raises(PlanError, match=r"stage 0: model_collectives lists .* for the layers 0\.\.\d+ of a stage on a 3-axis mesh"):
        plan_from_dict(raw)
    narrow = solve(_matmul_chain(hidden=128, tokens=4096, dtype=jnp.bfloat16), cluster)
    assert all(len(s.mesh_shape) <= 2 and not s.model_collectives for s in narrow.stages), [s.mesh_shape for s in narrow.stages]

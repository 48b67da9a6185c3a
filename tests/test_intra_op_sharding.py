"""Intra-op sharding of a stage on a data x model mesh: the known answers, checked in
the compiled HLO, and parity with one device on every mesh shape."""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import hetpar
from hetpar.shard.strategies import stage_problem
from hetpar.pipeline import layers_of
from hetpar.trace.traced_step import trace_step
from models import gpt, mlp
from parity import assert_close, run_parity, with_grads
from solver.collectives import LinkCost
from solver.intra_op import IntraOpError, solve_intra_op


class TwoLayer(nn.Module):
    hidden: int
    out: int

    @nn.compact
    def __call__(self, x):
        hidden = nn.relu(nn.Dense(self.hidden, use_bias=False, name="up")(x))
        return nn.Dense(self.out, use_bias=False, name="down")(hidden)


def two_layer(batch: int, width: int, hidden: int):
    model = TwoLayer(hidden, 64)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    y = jax.random.normal(jax.random.key(2), (batch, 64))
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x), tx=optax.sgd(0.1))

    def loss_fn(params, b):
        return jnp.mean((model.apply(params, b["x"]) - b["y"]) ** 2)

    return state, {"x": x, "y": y}, loss_fn


def collectives(par, kind: str) -> dict[str, list[str]]:
    """The result types of the collective instructions in the compiled programs of
    one `kind` (pre/fwd/bwd/post), by collective."""
    step = par.compiled()
    found: dict[str, list[str]] = {name: [] for name in ("all-reduce", "all-gather", "all-to-all", "reduce-scatter")}
    for program in step.programs:
        if program.task.kind != kind:
            continue
        text = program.lower().compile().as_text()
        for name in found:  # XLA may combine several into one instruction of a tuple type
            for result in re.findall(rf"= (.+?) {name}(?:-start)?\(", text):
                found[name] += re.findall(r"\w+\[[\d,]*\]", result)
    return found


def specs_by_layer(par) -> dict[str, str]:
    return {path: spec for s in par.plan.stages for path, spec in s.param_specs if "opt_state" not in path}


def test_wide_mlp_small_batch_gets_megatrons_split():
    state, batch, loss_fn = two_layer(batch=8, width=512, hidden=4096)
    par = hetpar.parallelize(with_grads(loss_fn), cluster=hetpar.Cluster.virtual({"cpu": 4}), num_stages=1, mesh_shape=(1, 4))
    out = par(state, batch)
    expected = jax.jit(with_grads(loss_fn))(state, batch)
    assert jnp.allclose(out[1], expected[1], rtol=1e-5)
    specs = specs_by_layer(par)
    assert specs["[0].params['params']['up']['kernel']"] == (None, 'model')  # columns
    assert specs["[0].params['params']['down']['kernel']"] == ('model', None)  # rows
    found = collectives(par, "fwd")  # the last stage runs forward and backward in one program
    # One all-reduce, of the second matmul's partial sums; no resharding anywhere.
    assert found["all-reduce"] == ["f32[8,64]"]
    assert not found["all-gather"] and not found["all-to-all"]


class Attention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        return nn.MultiHeadDotProductAttention(num_heads=self.heads, use_bias=False, name="attn")(x)


def test_attention_splits_by_heads():
    model = Attention(heads=8)
    x = jax.random.normal(jax.random.key(1), (2, 16, 512))
    batch = {"x": x, "y": jax.random.normal(jax.random.key(2), (2, 16, 512))}
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x), tx=optax.sgd(0.1))

    def loss_fn(params, b):
        return jnp.mean((model.apply(params, b["x"]) - b["y"]) ** 2)

    par = hetpar.parallelize(with_grads(loss_fn), cluster=hetpar.Cluster.virtual({"cpu": 4}), num_stages=1, mesh_shape=(1, 4))
    out = par(state, batch)
    assert_close(out[1:], jax.jit(with_grads(loss_fn))(state, batch)[1:], "loss and gradients")
    specs = specs_by_layer(par)
    for projection in ("query", "key", "value"):  # (d_model, heads, head_dim): by heads
        assert specs[f"[0].params['params']['attn']['{projection}']['kernel']"] == (None, 'model', None)
    assert specs["[0].params['params']['attn']['out']['kernel']"] == ('model', None, None)
    found = collectives(par, "fwd")
    # Each device attends with its own heads; one all-reduce joins the output projection's partial sums.
    assert found["all-reduce"] == ["f32[2,16,512]"]
    assert not found["all-gather"] and not found["all-to-all"]


@pytest.mark.parametrize("batch, width, hidden, shape", [(8, 512, 4096, (1, 4)), (512, 64, 64, (4,))],
                         ids=["wide-small-batch", "narrow-large-batch"])
def test_single_type_cluster_gets_one_stage_meshed_by_the_ilp(batch, width, hidden, shape):
    """No stage count, no mesh shape: the planner makes one 4-device stage and the
    sharding solver splits it into a model axis only where that pays."""
    state, data, loss_fn = two_layer(batch=batch, width=width, hidden=hidden)
    par = hetpar.parallelize(with_grads(loss_fn), cluster=hetpar.Cluster.virtual({"cpu": 4}))
    out = par(state, data)
    assert_close(out[1:], jax.jit(with_grads(loss_fn))(state, data)[1:], "loss and gradients")
    assert [s.mesh_shape for s in par.plan.stages] == [shape]
    if shape == (1, 4):
        specs = specs_by_layer(par)
        assert specs["[0].params['params']['up']['kernel']"] == (None, 'model')
        assert specs["[0].params['params']['down']['kernel']"] == ('model', None)


def test_a_mesh_whose_solve_without_a_budget_loses_is_not_solved_further(monkeypatch):
    """Choosing a stage's mesh compares each mesh's ILP cost with the cheapest so far;
    a mesh whose solve without a memory budget already costs no less cannot win under
    one, so it is not solved further (`_StageSolver.cost`): the plan is the one that
    solving every mesh in full gives, with fewer meshes solved."""
    import hetpar.shard as shard

    state, data, loss_fn = two_layer(batch=8, width=512, hidden=4096)
    full_solve = shard._StageSolver.solve

    def planned(prune: bool):
        solved = set()

        def solve(self, stage, mesh):
            solved.add(tuple(mesh.items()))
            return full_solve(self, stage, mesh)

        with monkeypatch.context() as m:
            m.setattr(shard._StageSolver, "solve", solve)
            if not prune:
                m.setattr(shard._StageSolver, "cost", lambda self, stage, mesh, beat=float("inf"): solve(self, stage, mesh)[1])
            made = hetpar.make_plan(with_grads(loss_fn), (state, data), hetpar.Cluster.virtual({"cpu": 4}))
        return [(s.mesh_shape, s.shardings, s.operand_shardings) for s in made.stages], solved

    pruned, solved_pruned = planned(True)
    full, solved_full = planned(False)
    assert pruned == full and full[0][0] == (1, 4)
    assert solved_pruned < solved_full


def test_large_batch_small_weights_stay_data_parallel():
    state, batch, loss_fn = two_layer(batch=4096, width=64, hidden=64)
    par = hetpar.parallelize(with_grads(loss_fn), cluster=hetpar.Cluster.virtual({"cpu": 4}), num_stages=1, mesh_shape=(1, 4))
    par(state, batch)
    specs = specs_by_layer(par)
    assert specs["[0].params['params']['up']['kernel']"] == (None, None)
    assert specs["[0].params['params']['down']['kernel']"] == (None, None)
    found = collectives(par, "fwd")
    assert not found["all-to-all"]
    # The weight gradients, summed over the devices that hold the examples.
    assert found["all-reduce"].count("f32[64,64]") == 2
    assert not found["all-gather"]


def test_memory_budget_below_replicated_weights_shards_them():
    state, batch, loss_fn = two_layer(batch=256, width=32, hidden=32)
    traced = trace_step(with_grads(loss_fn), (state, batch), 1, 1)
    batch_free = {v for v in traced.full.invars if v not in traced.analysis.batch_axis}
    mesh, link = {"data": 1, "model": 4}, LinkCost(1e9, 1e-3)  # collectives dear: unbudgeted, nothing is split
    ops = list(range(len(traced.full.ops)))
    free = stage_problem(traced.full, ops, batch_free, mesh, 5e10, link)
    replicated = sum(4 * traced.full.nbytes(w) for w in free.weights)
    tight = stage_problem(traced.full, ops, batch_free, mesh, 5e10, link, memory_budget=replicated // 2)
    for problem, sharded in ((free, False), (tight, True)):
        solution = solve_intra_op(problem.problem)
        layouts = [problem.choices[n][solution.choice[n]] for n, _, _ in problem.weights.values()]
        specs = [(c.lhs, c.rhs)[pos] for c, (_, pos, _) in zip(layouts, problem.weights.values())]
        assert any("model" in spec for spec in specs) == sharded
    # Below a quarter of the replicated state nothing fits: the error names the least budget.
    smallest = sum(4 * traced.full.nbytes(w) // 4 for w in free.weights)
    impossible = stage_problem(traced.full, ops, batch_free, mesh, 5e10, link, memory_budget=smallest - 1)
    with pytest.raises(IntraOpError, match=f"smallest budget any sharding fits is {smallest} bytes"):
        solve_intra_op(impossible.problem)


def test_identical_blocks_are_solved_once():
    workload = gpt.setup(batch_size=4, config=gpt.GPTConfig(n_layers=4))
    traced = trace_step(with_grads(workload.loss_fn), (workload.state, workload.batch), 1, 1)
    batch_free = {v for v in traced.full.invars if v not in traced.analysis.batch_axis}
    ops = list(range(len(traced.full.ops)))
    layers = layers_of(traced, 4)
    stage = stage_problem(traced.full, ops, batch_free, {"data": 2, "model": 4}, 5e10, LinkCost(1e10, 1e-5),
                          batch_axis=traced.analysis.batch_axis, op_layer=layers.op_layer)
    problem = stage.problem
    copies = [k for k, r in enumerate(problem.same_as) if k != r]
    blocks = [{problem.same_as[k] for k, i in enumerate(stage.dots) if layers.op_layer.get(i) == b} for b in range(4)]
    assert copies and blocks[1] and blocks[1] == blocks[2]  # the middle blocks copy one set of free matmuls
    solution = solve_intra_op(problem)
    assert all(solution.choice[k] == solution.choice[problem.same_as[k]] for k in copies)


MESHES = [(1, 4), (2, 2), (2, 4)]  # model axis only; both axes, square and wide


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sharded_stage_parity(shape):
    devices = shape[0] * shape[1]
    for workload in (mlp.setup(batch_size=16, depth=2, hidden=64), gpt.setup(batch_size=8, config=gpt.GPTConfig(n_layers=2))):
        plan = run_parity(workload, hetpar.Cluster.virtual({"cpu": devices}), num_stages=1, mesh_shape=shape, num_microbatches=2)
        assert plan.stages[0].mesh_shape == shape


def test_sharded_stages_of_different_shapes_parity():
    shapes = ((2, 2), (1, 4))
    wide = gpt.GPTConfig(d_model=256, n_heads=4, n_layers=2)  # wide enough that splitting weights pays
    plan = run_parity(gpt.setup(batch_size=4, config=wide), hetpar.Cluster.virtual({"cpu": 8}), num_stages=2, mesh_shape=shapes,
                      num_microbatches=2, num_layers=2, schedule="1f1b")
    assert tuple(s.mesh_shape for s in plan.stages) == shapes
    specs = [spec for s in plan.stages for _, spec in s.param_specs]
    assert any("model" in spec for spec in specs)  # weights split over the model axis, differently per stage


def test_three_device_types_with_meshes_of_different_shapes_parity():
    shapes = ((2, 2), (1, 2), (2, 1))  # a model axis, then all model, then all data
    wide = gpt.GPTConfig(d_model=256, n_heads=4, n_layers=3)
    cluster = hetpar.Cluster.virtual({"H100": 4, "A100": 2, "V100": 2})
    plan = run_parity(gpt.setup(batch_size=8, config=wide), cluster, num_stages=3, mesh_shape=shapes, num_microbatches=2,
                      num_layers=3, schedule="1f1b")
    assert tuple(s.mesh_shape for s in plan.stages) == shapes
    assert [s.device_type for s in plan.stages] == ["H100", "A100", "V100"]


def test_mesh_shape_must_fit_the_stage():
    state, batch, loss_fn = two_layer(batch=8, width=32, hidden=32)
    par = hetpar.parallelize(with_grads(loss_fn), cluster=hetpar.Cluster.virtual({"cpu": 4}), num_stages=1, mesh_shape=(3, 2))
    with pytest.raises(hetpar.PlanError, match=r"mesh_shape \(3, 2\) does not fit stage 0's 4 devices"):
        par(state, batch)


def test_identical_stage_problems_are_solved_once():
    """Stages holding the same blocks pose the same ILP up to operator names: the
    second is answered from the first solve."""
    from hetpar.shard import _solve_once
    from solver.intra_op import IntraOpProblem, Node, Strategy

    def problem(prefix):
        options = (Strategy("split", 1.0, 0.25, 0), Strategy("replicate", 2.0, 0.0, 0))
        return IntraOpProblem(tuple(Node(f"{prefix}/dot_general#{i}", options) for i in range(3)))

    first = _solve_once(problem("Block_0"), 5.0)
    assert first.choice == (0, 0, 0)
    assert _solve_once(problem("Block_7"), 5.0) is first
    assert _solve_once(problem("Block_7"), 6.0) is not first  # another time limit may answer differently


def test_chunks_sharing_devices_share_their_memory_budget():
    """An interleaved plan's chunks on one device group split its memory in proportion
    to the planner's figures: budgeted against the whole device each, two chunks that
    each fit overflowed it together (Llama-2-7B on three_types_768 needed 107 GiB of 72)."""
    from hetpar.plan import StagePlan
    from hetpar.shard import memory_share

    def stage(index, ids, memory):
        return StagePlan(index, "H100", ids, index, index + 1, "", 1.0, 1.0, 1.0, memory_bytes=memory, memory_capacity=72)

    alone, first, second = stage(0, (0, 1), 10), stage(1, (2, 3), 30), stage(2, (2, 3), 10)
    plan = SimpleNamespace(stages=(alone, first, second))
    assert memory_share(alone, plan) == 72
    assert (memory_share(first, plan), memory_share(second, plan)) == (54, 18)
    unplanned = SimpleNamespace(stages=(replace(first, memory_bytes=0), replace(second, memory_bytes=0)))
    assert memory_share(unplanned.stages[0], unplanned) == 36


def test_the_ilp_prices_a_matmul_as_the_planner_does():
    """A matmul's piece on each device runs at the rate the planner gives a matmul of
    that size (`solver.efficiency`'s curve at the kind's sustained rate), not at the
    flat datasheet peak: the ILP and the planner agree on a matmul's time."""
    from hetpar.plan.auto import device_kinds
    from hetpar.shard import matmul_speed
    from solver.efficiency import matmul_time

    kind = device_kinds(hetpar.Cluster.virtual({"A100": 4}), "float32")[0]
    sustained, half = matmul_speed("A100", "float32")
    assert (sustained, half) == (kind.flops, kind.matmul_half_flops) and half > 0
    state, batch, loss_fn = two_layer(batch=64, width=256, hidden=512)
    traced = trace_step(with_grads(loss_fn), (state, batch), 1, 1)
    batch_free = {v for v in traced.full.invars if v not in traced.analysis.batch_axis}
    problem = stage_problem(traced.full, list(range(len(traced.full.ops))), batch_free, {"data": 1, "model": 4}, sustained,
                            LinkCost(1e11, 1e-6), matmul_half_flops=half)
    first = traced.full.ops[problem.dots[0]]  # the forward's x @ up: 2 * 64 * 256 * 512 FLOPs
    flops = 2 * 64 * 256 * 512
    assert [traced.full.avals[v].shape for v in first.inputs] == [(64, 256), (256, 512)]
    for strategy, choice in zip(problem.problem.nodes[0].strategies, problem.choices[0]):
        split = 4 if "model" in choice.lhs + choice.rhs else 1
        assert strategy.compute_s == pytest.approx(matmul_time(flops / split, flops / split, kind.flops, kind.matmul_half_flops))
        assert strategy.compute_s == pytest.approx((flops / split + half) / sustained)  # the curve's closed form

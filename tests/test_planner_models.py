"""What the planner sees of real model shapes: parameters behind mixed-precision
casts, Megatron's tensor-parallel traffic, forced recomputation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetpar.cluster.cluster import Cluster
from hetpar.plan.auto import SearchOptions, problem_for
from hetpar.pipeline import layers_of
from hetpar.trace.traced_step import trace_step
from models import llama
from hetpar.trace.flops import op_costs
from solver.collectives import Topology, best
from solver.efficiency import matmul_time
from solver.planner.search import Planner
from solver.cost.stage_costs import StageConfig

CONFIG = llama.LlamaConfig(n_layers=2, dtype=jnp.bfloat16, param_dtype=jnp.float32)
BATCH = 8


@pytest.fixture(scope="module")
def llama_layers():
    w = llama.setup(BATCH, CONFIG)
    traced = trace_step(w.step, (w.state, w.batch), 1, 2)
    return w, traced, layers_of(traced, 4)


@pytest.fixture(scope="module")
def cluster():
    return Cluster.from_file("examples/clusters/virtual_8.yaml").numbered()


def test_mixed_precision_parameters_are_counted(llama_layers):
    """f32 parameters cast to bf16 before use: their f32 bytes are the layers' parameters."""
    w, _, layers = llama_layers
    leaves = jax.tree.leaves(w.state.params)
    assert all(x.dtype == jnp.float32 for x in leaves)
    assert sum(x.size for x in leaves) == CONFIG.param_count()  # the hand count matches the model
    assert sum(layers.param_bytes) == 4 * CONFIG.param_count()
    d, v = CONFIG.d_model, CONFIG.vocab_size
    assert layers.param_bytes[0] >= 4 * v * d  # the embedding sits in the first layer
    assert layers.param_bytes[-1] >= 4 * (d * v + d)  # the head and final norm in the last


def test_gradient_sync_and_optimizer_see_the_parameters(llama_layers, cluster):
    """One 4-way data-parallel stage: it all-reduces every f32 gradient and updates
    every parameter, at the byte counts computed from the shapes."""
    _, _, layers = llama_layers
    problem = problem_for(layers, cluster, BATCH, options=SearchOptions(zero_stages=(0,)))
    kind = problem.kind("a100")
    choice = Planner(problem).fixed_split([StageConfig("a100", 4, 1)], 1, BATCH, "1f1b", ())
    nbytes = 4 * CONFIG.param_count()
    stage = choice.stages[0]
    expected_sync = best("all_reduce", Topology(1, 4, kind.intra, kind.inter), nbytes)[1]
    assert stage.sync_s > 0 and stage.zero == 0
    np.testing.assert_allclose(stage.sync_s, expected_sync, rtol=1e-9)
    np.testing.assert_allclose(stage.optimizer_s, nbytes * problem.optimizer_traffic / kind.memory_bandwidth, rtol=1e-9)
    assert stage.memory_bytes >= problem.state_factor * nbytes
    # ZeRO-1 shards the optimizer state: each device updates and keeps a quarter of it,
    # and the updated parameters are all-gathered after the gradients' all-reduce
    # (solver.zero.zero_time, as the runtime's layouts do it).
    zero = Planner(problem_for(layers, cluster, BATCH, options=SearchOptions(zero_stages=(1,)))).fixed_split([StageConfig("a100", 4, 1)], 1, BATCH, "1f1b", ()).stages[0]
    assert zero.zero == 1
    gather = best("all_gather", Topology(1, 4, kind.intra, kind.inter), nbytes)[1]
    np.testing.assert_allclose(zero.sync_s, expected_sync + gather, rtol=1e-9)
    np.testing.assert_allclose(zero.optimizer_s, stage.optimizer_s / 4, rtol=1e-9)
    np.testing.assert_allclose(stage.memory_bytes - zero.memory_bytes, (problem.state_factor - 2) * nbytes * 3 / 4, rtol=1e-6)


def test_tensor_parallel_traffic_is_megatrons_two_sums_each_way(llama_layers, cluster):
    """Each block all-reduces its attention output and its MLP output once in the
    forward and once in the backward, each a residual-stream activation."""
    _, traced, _ = llama_layers
    layers = layers_of(traced, CONFIG.n_layers)  # one block per layer
    hidden = BATCH * CONFIG.seq_len * CONFIG.d_model * 2  # bf16 activation, whole batch
    assert layers.tp_count == [2] * CONFIG.n_layers
    assert layers.tp_bytes == [2 * hidden] * CONFIG.n_layers
    problem = problem_for(layers, cluster, BATCH)
    costs = Planner(problem).costs
    kind = problem.kind("a100")
    per = costs.per_layer(StageConfig("a100", 1, 2), BATCH)
    one_sum = best("all_reduce", Topology(1, 2, kind.intra, kind.intra), hidden)[1]
    for layer in range(CONFIG.n_layers):
        fwd, bwd = _by_hand(traced, layers, layer, BATCH, 2, kind)
        np.testing.assert_allclose(per.forward[layer] - fwd, 2 * one_sum, rtol=1e-9)
        np.testing.assert_allclose(per.backward[layer] - bwd, 2 * one_sum, rtol=1e-9)


def _by_hand(traced, layers, layer, examples, tp, kind):  # noqa: ANN001, ANN202
    """A layer's forward and backward compute seconds on one device of a `tp`-wide
    stage running `examples` examples, from its traced operators: each matmul at the
    efficiency curve's rate for its own size, the other FLOPs at the sustained rate,
    plus the kind's fixed cost per layer (a third forward, two thirds backward)."""
    flops = [c.flops for c in op_costs(traced.full)]
    share = examples / BATCH / tp  # the traced graph is the whole batch
    seconds = [kind.layer_overhead_s / 3, 2 * kind.layer_overhead_s / 3]
    for op, owner in layers.op_layer.items():
        if owner != layer or flops[op] <= 0:
            continue
        work = flops[op] * share
        if traced.full.ops[op].name == "dot_general":
            seconds[traced.analysis.backward[op]] += matmul_time(work, work, kind.flops, kind.matmul_half_flops)
        else:
            seconds[traced.analysis.backward[op]] += work / kind.flops
    return seconds


def test_traced_layers_price_each_matmul_by_its_size(llama_layers, cluster):
    """A traced block's small matmuls run below the sustained rate in the planner, as
    `solver.efficiency` says of each of them (and as the predictor prices them), not at
    the flat rate; with one example per device the curve costs them dearly."""
    _, traced, _ = llama_layers
    layers = layers_of(traced, CONFIG.n_layers)
    assert all(f >= 7 and b >= 2 * f - 1 for f, b in zip(layers.matmuls, layers.backward_matmuls))  # q k v o, scores, context, mlp
    problem = problem_for(layers, cluster, BATCH)
    kind = problem.kind("a100")
    assert kind.matmul_half_flops > 0
    costs = Planner(problem).costs
    for examples in (1, BATCH):
        per = costs.per_layer(StageConfig("a100", 1, 1), examples)
        for layer in range(CONFIG.n_layers):
            fwd, bwd = _by_hand(traced, layers, layer, examples, 1, kind)
            np.testing.assert_allclose([per.forward[layer], per.backward[layer]], [fwd, bwd], rtol=1e-9)
    one = costs.per_layer(StageConfig("a100", 1, 1), 1)
    flat = costs.fwd_flops / kind.flops + kind.layer_overhead_s / 3
    assert (one.forward > 1.5 * flat).all()  # far from the flat rate: the test can tell


def test_recomputation_can_be_forced(llama_layers, cluster):
    """Forced, every stage recomputes its forward in the backward though memory does not ask.
    The planner prices a recomputing stage with what its rerun really holds (the traced
    layers' `recomputed_bytes`, less than every value the backward reads): its memory is
    the placement pass's figure for the same plan."""
    from dataclasses import replace

    from hetpar.plan.auto import to_plan
    from hetpar.pipeline import _operator_stages, placement_pass

    _, traced, layers = llama_layers
    free = Planner(problem_for(layers, cluster, BATCH, options=SearchOptions(zero_stages=(0,))))
    forced = Planner(problem_for(layers, cluster, BATCH, options=SearchOptions(force_remat=True, zero_stages=(0,))))
    configs, cuts = [StageConfig("a100", 2, 1), StageConfig("v100", 2, 1)], (2,)
    a = free.fixed_split(configs, 2, BATCH // 2, "1f1b", cuts)
    b = forced.fixed_split(configs, 2, BATCH // 2, "1f1b", cuts)
    for s, r in zip(a.stages, b.stages):
        assert not s.remat and r.remat
        np.testing.assert_allclose(r.backward_s, s.backward_s + s.forward_s, rtol=1e-9)
    first, last = zip(a.stages, b.stages)
    assert first[1].memory_bytes < first[0].memory_bytes
    assert last[1].memory_bytes == last[0].memory_bytes  # forward and backward are one program there: nothing to drop
    assert sum(layers.recomputed_bytes[:2]) < 0.9 * sum(layers.saved_bytes[:2])  # the two figures differ
    plan = to_plan(b, layers, cluster)
    plan = placement_pass(traced, layers, replace(plan, operator_stages=_operator_stages(traced, layers, plan),
                                                  cost_inputs=forced.problem))
    for s, placed in zip(b.stages, plan.stages):
        assert placed.remat == "full" and placed.memory_bytes == pytest.approx(s.memory_bytes, rel=1e-6, abs=64)
    chosen = forced.solve().best
    assert all(s.remat for s in chosen.stages)


def test_solve_lets_the_planner_choose_the_microbatch_count(cluster):
    from hetpar.cli import parser
    from hetpar.pipeline import make_plan
    from models import mlp

    args = parser().parse_args(["solve", "mlp", "--cluster", "c.yaml"])
    assert args.microbatches is None  # the CLI default: the planner's choice
    w = mlp.setup(batch_size=16, in_dim=16, hidden=16, depth=4)
    chosen = make_plan(w.step, (w.state, w.batch), cluster, num_microbatches=None)
    single = make_plan(w.step, (w.state, w.batch), cluster, num_microbatches=1)
    assert 16 % chosen.num_microbatches == 0 and single.num_microbatches == 1
    assert chosen.predicted_step_time_s <= single.predicted_step_time_s * (1 + 1e-9)

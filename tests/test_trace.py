"""Tracing, operator costs and layer construction."""

import jax
import jax.numpy as jnp
import pytest

from hetpar.trace import jaxpr_ir
from hetpar.trace.flops import graph_flops
from hetpar.trace.layers import build_layers
from hetpar.trace.microbatch import Phase, analyze, input_roles
from hetpar.trace.flops import op_costs
from models import gpt, mlp


def _xla_flops(fn, *args):
    return jax.jit(fn).lower(*args).cost_analysis()["flops"]


def _mlp_step():
    w = mlp.setup(batch_size=32, hidden=64)
    return w.step, (w.state, w.batch)


def _gpt_step():
    w = gpt.setup(batch_size=8)
    return w.step, (w.state, w.batch)


def _scan_fn(unroll=False):
    ws = jnp.ones((6, 32, 32))

    def fn(x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws, unroll=unroll)[0].sum()

    return jax.grad(fn), (jnp.ones((16, 32)),)


def test_scan_costs_its_body_times_its_length():
    # XLA counts a loop body once whatever the trip count; unrolled, it counts them all.
    fn, args = _scan_fn()
    unrolled, _ = _scan_fn(unroll=True)
    assert graph_flops(jaxpr_ir.trace(fn, *args)) == pytest.approx(_xla_flops(unrolled, *args), rel=0.05)


def _remat_nested_jit():
    @jax.jit
    def layer(w, x):
        return jax.nn.gelu(x @ w)

    def loss(w, x):
        return jax.checkpoint(lambda x: layer(w, layer(w, x)))(x).mean()

    return jax.grad(loss), (jnp.ones((64, 64)), jnp.ones((32, 64)))


def _conv():
    def fn(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")).sum()

    return jax.grad(fn, argnums=(0, 1)), (jnp.ones((4, 16, 16, 8)), jnp.ones((3, 3, 8, 16)))


def _attention():
    def fn(q, k, v, g):
        s = jax.nn.softmax(q @ k.T / 8.0, axis=-1) @ v
        mu = s.mean(-1, keepdims=True)
        return (g * (s - mu) * jax.lax.rsqrt(s.var(-1, keepdims=True) + 1e-5)).sum()

    x = jnp.ones((64, 32))
    return jax.value_and_grad(fn, argnums=(0, 1, 2)), (x, x, x, jnp.ones((32,)))


@pytest.mark.parametrize("make", [_mlp_step, _gpt_step, _remat_nested_jit, _conv, _attention])
def test_flops_agree_with_xla_within_5_percent(make):
    fn, args = make()
    ours = graph_flops(jaxpr_ir.trace(fn, *args))
    xla = _xla_flops(fn, *args)
    assert ours == pytest.approx(xla, rel=0.05), f"ours {ours:.4g} vs XLA {xla:.4g}"


def test_calls_are_inlined_and_loops_kept_whole():
    fn, args = _remat_nested_jit()
    names = {op.name for op in jaxpr_ir.trace(fn, *args).ops}
    assert not names & {"jit", "pjit", "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call"}
    fn, args = _scan_fn()
    assert "scan" in {op.name for op in jaxpr_ir.trace(fn, *args).ops}


def _analyzed(workload, batch_size):
    def at(size):
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype), workload.batch)
        return jaxpr_ir.trace(workload.step, workload.state, batch)

    full, probe = at(batch_size), at(2 * batch_size)
    batch_invars = full.invars[-len(jax.tree.leaves(workload.batch)) :]
    return full, analyze(full, probe, batch_invars)


def test_microbatch_analysis_finds_gradients_and_optimizer():
    w = gpt.setup(batch_size=4)
    graph, analysis = _analyzed(w, 4)
    phases = {p for p in analysis.phase}
    assert phases == {Phase.PRE, Phase.MICRO, Phase.POST}
    # One reduction per parameter leaf (its gradient) plus the loss sum, all combined by sum.
    assert len(analysis.reductions) >= len(jax.tree.leaves(w.state.params)) + 1
    assert set(analysis.reductions.values()) == {"sum"}
    # The optimizer (sqrt of Adam's second moment) runs once, after the microbatches.
    sqrt_phases = {analysis.phase[op.index] for op in graph.ops if op.name == "sqrt"}
    assert Phase.POST in sqrt_phases and Phase.MICRO not in sqrt_phases


@pytest.mark.parametrize("n_blocks", [2, 4, 6])
def test_gpt_with_n_blocks_cut_into_n_layers_cuts_at_block_boundaries(n_blocks):
    w = gpt.setup(batch_size=4, config=gpt.GPTConfig(n_layers=n_blocks))
    graph, analysis = _analyzed(w, 4)
    layers = build_layers(graph, analysis, [c.flops for c in op_costs(graph)], n_blocks)
    blocks_in_layer = [set() for _ in range(n_blocks)]
    for op, layer in layers.op_layer.items():
        path = graph.ops[op].module_path
        if len(path) > 1 and path[1].startswith("Block_"):
            blocks_in_layer[layer].add(path[1])
    assert blocks_in_layer == [{f"Block_{i}"} for i in range(n_blocks)]


def test_tensor_parallel_bytes_are_megatrons_two_sums_per_block():
    config = gpt.GPTConfig(n_layers=3)
    w = gpt.setup(batch_size=4, config=config)
    graph, analysis = _analyzed(w, 4)
    layers = build_layers(graph, analysis, [c.flops for c in op_costs(graph)], 3)
    hidden = 4 * config.seq_len * config.d_model * 4  # one f32 residual-stream activation, whole batch
    # (qkv, proj) and (up, down) pair up; each pair sums the narrow result. The head has no partner.
    assert layers.tp_bytes == [2 * hidden] * 3


def test_layers_are_balanced_by_flops():
    w = mlp.setup(batch_size=32, in_dim=64, hidden=64, depth=8)
    graph, analysis = _analyzed(w, 32)
    layers = build_layers(graph, analysis, [c.flops for c in op_costs(graph)], 4)
    assert max(layers.flops) <= 1.5 * min(layers.flops)


def test_input_roles_come_from_the_program():
    w = mlp.setup(batch_size=8)
    graph, analysis = _analyzed(w, 8)
    batch_invars = graph.invars[-len(jax.tree.leaves(w.batch)) :]
    roles = input_roles(graph, analysis, batch_invars)
    leaves = jax.tree_util.tree_flatten_with_path((w.state, w.batch))[0]
    by_path = {jax.tree_util.keystr(path): roles[v] for (path, _), v in zip(leaves, graph.invars)}
    assert {r for p, r in by_path.items() if ".params" in p} == {"parameter"}
    assert {r for p, r in by_path.items() if ".opt_state" in p or p.endswith(".step")} == {"optimizer_state"}
    assert [r for p, r in by_path.items() if p.startswith("[1]")] == ["batch", "batch"]


def test_op_bytes_in_and_out():
    def fn(x, w):
        return x @ w

    graph = jaxpr_ir.trace(fn, jnp.ones((4, 8)), jnp.ones((8, 2)))
    (cost,) = op_costs(graph)
    assert (cost.flops, cost.bytes_in, cost.bytes_out) == (2 * 4 * 2 * 8, (32 + 16) * 4, 8 * 4)

"""A scan over layers (flax `nn.scan`, `jax.lax.scan` over stacked weights) is split
at iteration boundaries (issue 14, item 3): stages take iterations i..j, the planner
sees each iteration's cost, and the stacked parameters, their gradients and optimizer
state come back whole, as `jax.jit` returns them. `nnx.scan` runs with parity; its
split between stages is still open."""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import hetpar
from hetpar.trace.flops import op_costs
from hetpar.trace.layers import block_count
from hetpar.trace.traced_step import trace_step
from parity import assert_close, assert_reads_in_place, with_grads

TWO = {"A100": 4, "V100": 4}
THREE = {"H100": 2, "A100": 2, "V100": 4}
D, LAYERS = 16, 4


# Two stages over A100s and V100s balanced by peak speed give the V100s the head alone (the cut
# falls between blocks now, and at f32 the A100s' tensor cores rate them 10x faster): a uniform
# split, as many layers per stage, puts the scan on both whatever the kinds' speeds.
_SPLIT = hetpar.StageOption(mode="uniform")


class Block(nn.Module):
    """A pre-LayerNorm transformer block, as scanned models write it."""

    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=D, deterministic=True)(h)
        x = x + h
        h = nn.Dense(2 * D)(nn.LayerNorm()(x))
        return x + nn.Dense(D)(nn.gelu(h)), None


def _net(remat: bool):
    block = nn.remat(Block, prevent_cse=False) if remat else Block

    class Net(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(32, D)(tokens)
            x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)()(x, None)
            return nn.Dense(32)(nn.LayerNorm()(x))

    return Net()


def _workload(remat: bool = False, batch: int = 8):
    net = _net(remat)
    tokens = jax.random.randint(jax.random.key(1), (batch, 6), 0, 32)
    params = net.init(jax.random.key(0), tokens)
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.sgd(0.1, momentum=0.9))  # adam would amplify the key bias's ~0 gradient noise

    def loss_fn(p, batch):
        logits = net.apply(p, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return state, {"x": tokens, "y": jnp.roll(tokens, 1, axis=1)}, loss_fn


def _parity(state, batch, loss_fn, cluster, steps=2, **options):
    step = with_grads(loss_fn)
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(cluster), **options)
    ref_state = par_state = state
    for i in range(steps):
        ref_state, ref_loss, ref_grads = jax.jit(step)(ref_state, batch)
        par_state, par_loss, par_grads = parallel(par_state, batch)
        assert_close(par_loss, ref_loss, f"loss, step {i}")
        assert_close(par_grads, ref_grads, f"gradients, step {i}")
        assert_close(par_state.params, ref_state.params, f"parameters after step {i}")
        assert_close(par_state.opt_state, ref_state.opt_state, f"optimizer state after step {i}")
    return parallel.plan


@pytest.mark.parametrize("cluster,stages,microbatches,schedule,batch_size", [
    (TWO, 2, 2, "gpipe", 8),
    (TWO, 2, 4, "1f1b", 8),
    (THREE, 3, 1, "gpipe", 8),
    (THREE, 3, 8, "1f1b", 16),
])
def test_scanned_blocks_split_over_stages(cluster, stages, microbatches, schedule, batch_size):
    state, batch, loss_fn = _workload(batch=batch_size)
    # Two steps (the second reads the stacked parameters where the first left them) once; one elsewhere, for time.
    plan = _parity(state, batch, loss_fn, cluster, steps=2 if microbatches == 2 else 1, num_microbatches=microbatches,
                   num_stages=stages, schedule=schedule, stage_option=_SPLIT if cluster is TWO else None)
    # The scanned blocks are spread: more than one stage runs some of them.
    scanned = [s for s in plan.stages if "ScanBlock" in s.layer_names]
    assert len(scanned) >= 2, [s.layer_names for s in plan.stages]


def test_remat_scanned_blocks():
    state, batch, loss_fn = _workload(remat=True)
    _parity(state, batch, loss_fn, TWO, num_microbatches=2, num_stages=2, schedule="1f1b")


def test_lax_scan_over_stacked_weights_three_types():
    """No flax: `jax.lax.scan` over a stacked weight array, the plain-JAX form."""
    stacked = {"w": jax.random.normal(jax.random.key(2), (6, D, D)) * 0.3, "b": jnp.zeros((6, D))}
    params = {"layers": stacked, "head": jax.random.normal(jax.random.key(3), (D, 2)) * 0.3}
    batch = {"x": jax.random.normal(jax.random.key(4), (8, D)), "y": jax.random.normal(jax.random.key(5), (8, 2))}

    def loss_fn(p, batch):
        h, _ = jax.lax.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]) + h, None), batch["x"], p["layers"])
        return jnp.mean((h @ p["head"] - batch["y"]) ** 2)

    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    plan = _parity(state, batch, loss_fn, THREE, num_microbatches=4, num_stages=3, schedule="gpipe")
    assert sum("scan[" in s.layer_names for s in plan.stages) >= 2, [s.layer_names for s in plan.stages]


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(self.norm(x)))


class NnxNet(nnx.Module):
    """Blocks made by `nnx.vmap` (stacked parameters) and run by `nnx.scan`, the
    form flax's nnx guide gives for scanned layers. nnx names no scopes, and the
    scan's first input is the batch itself, so the only module boundaries are the
    iterations'."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return NnxBlock(rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.head(run(x, self.blocks))


def test_nnx_scan_split_over_stages():
    graphdef, params = nnx.split(NnxNet(nnx.Rngs(0)))
    batch = {"x": jax.random.normal(jax.random.key(4), (8, D)), "y": jax.random.normal(jax.random.key(5), (8, 2))}

    def loss_fn(p, batch):
        return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    plan = _parity(state, batch, loss_fn, TWO, steps=1, num_microbatches=2, num_stages=2, schedule="1f1b",
                   stage_option=_SPLIT)
    assert sum("scan[" in s.layer_names for s in plan.stages) >= 2, [s.layer_names for s in plan.stages]


def test_planner_sees_each_iteration():
    """Every iteration of the scan is a piece the planner can place, with the body's
    cost; the stacked parameters have their gradients in the step's outputs."""
    state, batch, loss_fn = _workload()
    traced = trace_step(with_grads(loss_fn), (state, batch), 1, 2)
    flops = [c.flops for c in op_costs(traced.full)]
    per_iteration = [sum(f for op, f in zip(traced.full.ops, flops) if f"ScanBlock_0[{t}]" in op.scope)
                     for t in range(LAYERS)]
    assert per_iteration[0] > 0 and all(f == pytest.approx(per_iteration[0]) for f in per_iteration)
    assert block_count(traced.full, traced.analysis, flops) >= LAYERS
    assert "scan" not in {op.name for op in traced.full.ops}
    # The planner's own plan spreads the iterations over stages.
    plan = hetpar.make_plan(with_grads(loss_fn), (state, batch), hetpar.Cluster.virtual(THREE), num_microbatches=2)
    assert sum("ScanBlock_0[" in s.layer_names for s in plan.stages) >= 2, plan


def test_stacked_weights_are_cut_where_they_live():
    """Each stage receives its iterations' slices of a stacked weight, not the whole
    stack: every operator reading a stacked parameter runs on one stage."""
    state, batch, loss_fn = _workload()
    step = with_grads(loss_fn)
    traced = trace_step(step, (state, batch), 1, 2)
    plan = hetpar.make_plan(step, (state, batch), hetpar.Cluster.virtual(TWO), num_microbatches=2, num_stages=2,
                            stage_option=_SPLIT)
    stage = plan.stage_of_operators(0)
    stacked = [v for v, path in zip(traced.full.invars, traced.input_paths)
               if "params" in path and "ScanBlock_0" in path and "opt_state" not in path]
    assert stacked
    for v in stacked:
        readers = traced.full.consumers[v]
        assert len({stage[c] for c in readers}) == 1, traced.input_paths[traced.full.invars.index(v)]
    assert len({s.index for s in plan.stages if "ScanBlock_0" in s.layer_names}) == 2


def test_eval_like_the_step_keeps_stacked_weights_in_place():
    state, batch, loss_fn = _workload()
    step = with_grads(loss_fn)
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO), num_microbatches=2, num_stages=2)
    new_state, _, _ = parallel(state, batch)
    ref_state, _, _ = jax.jit(step)(state, batch)
    evaluate = hetpar.parallelize(loss_fn, like=parallel, batch_argnum=1)
    assert_close(evaluate(new_state.params, batch), jax.jit(loss_fn)(ref_state.params, batch), "eval")
    assert_reads_in_place(evaluate, new_state.params)

"""Blocks at any depth (issue 28, item 1): repeated blocks are found by structure, a
run of sibling modules with the same operators on the same shapes wherever they sit
in the module tree, and each becomes one layer, with the embedding and the head as
layers of their own. One test per model family on a tiny config with the real
module layout: transformers' FlaxLlama (`model/layers/N`), FlaxGPT2
(`transformer/h/N`), FlaxBert (`bert/encoder/layer/N`), a linen `nn.scan` model
(unrolled: `ScanBlock_0[N]`, also nested one module deeper), and nnx models (no
scopes: blocks found by their repeating operators). Each asserts the layer count
and that a plan cutting between blocks runs with parity."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state

import hetpar
from hetpar.pipeline import layers_of
from hetpar.trace.flops import op_costs
from hetpar.trace.layers import block_count, structure_of
from hetpar.trace.microbatch import Phase
from hetpar.trace.traced_step import trace_step
from parity import assert_close, with_grads

THREE = {"A100": 2, "V100": 2, "cpu": 2}
N = 3  # blocks in every tiny model


def _structure(traced):
    flops = [c.flops for c in op_costs(traced.full)]
    return structure_of(traced.full, traced.analysis, flops), block_count(traced.full, traced.analysis, flops)


def _blocks_stay_whole(traced, plan, marks: list[str]) -> set[int]:
    """Every forward operator of block i (its scope holds `marks[i]`) runs on one
    stage; returns the stages that run blocks."""
    stage = plan.stage_of_operators(0)
    used = set()
    for mark in marks:
        stages = {stage[op.index] for op in traced.full.ops
                  if traced.analysis.phase[op.index] is Phase.MICRO and not traced.analysis.backward[op.index]
                  and mark in op.scope}
        assert len(stages) == 1, (mark, stages)
        used |= stages
    return used


# transformers' Flax models ---------------------------------------------------------------

transformers = pytest.importorskip("transformers")  # a dev extra: `pip install -e .[dev]`


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=N,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.FlaxLlamaForCausalLM(cfg, seed=0), True, "model/layers"


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=N, n_head=2)
    return transformers.FlaxGPT2LMHeadModel(cfg, seed=0), True, "transformer/h"


def _bert():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=N, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=8)
    return transformers.FlaxBertForMaskedLM(cfg, seed=0), False, "bert/encoder/layer"


@pytest.mark.parametrize("make", [_llama, _gpt2, _bert], ids=["llama", "gpt2", "bert"])
def test_transformers_blocks_are_layers(make):
    from test_transformers import _batch, _lm_step

    model, causal, where = make()
    tx = optax.adamw(1e-3, eps=1e-3)
    step = _lm_step(model, tx, causal)
    state = (model.params, tx.init(model.params), jax.random.key(5))
    traced = trace_step(step, (state, _batch()), 1, 2)
    structure, count = _structure(traced)
    assert structure.blocks == N and count == N + 2, structure
    assert list(structure.labels[1:-1]) == [f"{where}/{i}" for i in range(N)]
    layers = layers_of(traced, N + 2)
    assert layers.names[1:-1] == [f"{where}/{i}" for i in range(N)]

    # Three stages over one layer per block plus embedding and head: cut between blocks, same numbers as jit.
    # Uniform (as many layers per stage): balanced by peak speed, the A100s would take every block.
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(THREE), num_microbatches=2, num_stages=3,
                                  num_layers=N + 2, stage_option=hetpar.StageOption(mode="uniform"))
    ref_state, ref_loss = jax.jit(step)(state, _batch())
    par_state, par_loss = parallel(state, _batch())
    assert_close(par_loss, ref_loss, "loss")
    assert_close(par_state, ref_state, "state")
    plan = parallel.plan
    assert plan.num_layers == N + 2
    marks = [f"{where.split('/')[-1]}/{i}/" for i in range(N)]
    assert len(_blocks_stay_whole(traced, plan, marks)) >= 2


def test_transformers_planner_plans_over_every_block():
    """The planner's own plan (auto) cuts at least at every block boundary."""
    from test_transformers import _batch, _lm_step

    model, causal, where = _llama()
    tx = optax.adamw(1e-3)
    step = _lm_step(model, tx, causal)
    state = (model.params, tx.init(model.params), jax.random.key(5))
    plan = hetpar.make_plan(step, (state, _batch()), hetpar.Cluster.virtual({"A100": 2, "V100": 2}),
                            num_microbatches=2)
    assert plan.num_layers >= N + 2
    traced = trace_step(step, (state, _batch()), 1, 2)
    layers = layers_of(traced, plan.num_layers)
    for i in range(N):  # each block's layers are its own
        mine = [n for n in layers.names if f"{where}/{i}" in n]
        assert mine and all(f"{where}/{j}" not in n for n in mine for j in range(N) if j != i), layers.names


# linen nn.scan ---------------------------------------------------------------------------


def _scan_workload(nested: bool):
    from test_scan_layers import Block, D, LAYERS

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)()(x, None)
            return x

    class Net(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(32, D)(tokens)
            if nested:
                x = Decoder()(x)
            else:
                x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)()(x, None)
            return nn.Dense(32)(nn.LayerNorm()(x))

    net = Net()
    tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, 32)
    params = net.init(jax.random.key(0), tokens)
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.sgd(0.1, momentum=0.9))

    def loss_fn(p, batch):
        logits = net.apply(p, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return state, {"x": tokens, "y": jnp.roll(tokens, 1, axis=1)}, loss_fn, LAYERS


def _parity_between_blocks(state, batch, loss_fn, num_layers, marks, cluster=None):
    step = with_grads(loss_fn)
    traced = trace_step(step, (state, batch), 1, 2)
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(cluster or THREE), num_microbatches=2,
                                  num_stages=3, num_layers=num_layers)
    ref_state, ref_loss, ref_grads = jax.jit(step)(state, batch)
    par_state, par_loss, par_grads = parallel(state, batch)
    assert_close(par_loss, ref_loss, "loss")
    assert_close(par_grads, ref_grads, "gradients")
    assert_close(par_state.params, ref_state.params, "parameters")
    assert parallel.plan.num_layers == num_layers
    if marks:
        assert len(_blocks_stay_whole(traced, parallel.plan, marks)) >= 2
    return parallel.plan


@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "nested"])
def test_linen_scan_iterations_are_layers(nested):
    """A scan of L steps is priced as L block layers (it is unrolled at trace, so the
    plan's layers are exactly what runs), at whatever depth the scan sits."""
    state, batch, loss_fn, length = _scan_workload(nested)
    traced = trace_step(with_grads(loss_fn), (state, batch), 1, 2)
    structure, count = _structure(traced)
    prefix = "Decoder_0/" if nested else ""
    assert structure.blocks == length and count == length + 2, structure
    assert list(structure.labels[1:-1]) == [f"{prefix}ScanBlock_0[{t}]" for t in range(length)]
    # More layers than pieces: every block boundary stays a cut, the rest cut inside blocks; names stay distinct.
    finer = layers_of(traced, count + 3)
    assert len(set(finer.names)) == len(finer.names) and "loss" not in finer.names, finer.names
    for t in range(length):
        assert any(f"ScanBlock_0[{t}]" in n for n in finer.names)
        assert not any(f"ScanBlock_0[{t}]" in n and f"ScanBlock_0[{u}]" in n for n in finer.names for u in range(length)
                       if u != t), finer.names
    _parity_between_blocks(state, batch, loss_fn, count, [f"ScanBlock_0[{t}]/" for t in range(length)],
                           cluster={"H100": 2, "A100": 2, "V100": 4})


# nnx -------------------------------------------------------------------------------------


class _Loop(nnx.Module):
    """Blocks in a Python list, called in a loop: nnx names no scopes, so the blocks
    are found by their repeating operators."""

    def __init__(self, rngs: nnx.Rngs):
        from test_scan_layers import D, NnxBlock

        self.embed = nnx.Linear(D, D, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(N)])
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _nnx_workload(module):
    from test_scan_layers import D

    graphdef, params = nnx.split(module)
    batch = {"x": jax.random.normal(jax.random.key(4), (8, D)), "y": jax.random.normal(jax.random.key(5), (8, 2))}

    def loss_fn(p, batch):
        return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    return state, batch, loss_fn


def test_nnx_loop_blocks_found_without_scopes():
    state, batch, loss_fn = _nnx_workload(_Loop(nnx.Rngs(0)))
    traced = trace_step(with_grads(loss_fn), (state, batch), 1, 2)
    structure, count = _structure(traced)
    assert structure.blocks == N and count == N + 2, structure
    assert list(structure.labels[1:-1]) == [f"block {i}" for i in range(N)]
    layers = layers_of(traced, count)
    # Each block holds one block's operators: the same work in every block.
    assert layers.forward_flops[1] == pytest.approx(layers.forward_flops[2]) == pytest.approx(layers.forward_flops[3])
    assert len(set(layers.names)) == len(layers.names)
    _parity_between_blocks(state, batch, loss_fn, count, [])


def test_nnx_scan_iterations_are_layers():
    from test_scan_layers import LAYERS, NnxNet

    state, batch, loss_fn = _nnx_workload(NnxNet(nnx.Rngs(0)))
    traced = trace_step(with_grads(loss_fn), (state, batch), 1, 2)
    structure, count = _structure(traced)
    # The first iteration reads the batch itself (no tangent in), so it differs from the others' operators;
    # it is still a layer of its own: one per iteration, and the head.
    assert count == LAYERS + 1, structure
    assert list(structure.labels[:-1]) == [f"scan[{t}]" for t in range(LAYERS)]
    _parity_between_blocks(state, batch, loss_fn, count, [f"scan[{t}]" for t in range(LAYERS)],
                           cluster={"A100": 2, "V100": 2, "cpu": 4})

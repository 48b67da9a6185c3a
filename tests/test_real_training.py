"""Training code as people write it (issue 14): dropout, padding-masked mean losses,
steps that only run whole, mixed precision. Parity against `jax.jit(step)` on one
device over 2 and 3 device types and 1, 2, 4 microbatches."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetpar
from parity import assert_close

TWO = {"A100": 2, "V100": 2}
THREE = {"A100": 2, "V100": 2, "cpu": 2}
B, T = 8, 6


class _Tiny(nn.Module):
    dropout: float = 0.3

    @nn.compact
    def __call__(self, x, train=True):
        for i in range(3):
            x = nn.relu(nn.Dense(16, name=f"Block_{i}")(x))
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(5, name="head")(x)


def _lm_batch(lengths=(6, 1, 3, 6, 2, 5, 4, 6)):
    """Token features, labels and a padding mask with uneven lengths, so every
    microbatch holds a different number of real tokens."""
    x = jax.random.normal(jax.random.key(1), (B, T, 8))
    labels = jax.random.randint(jax.random.key(2), (B, T), 0, 5)
    mask = (np.arange(T)[None] < np.asarray(lengths)[:, None]).astype(np.float32)
    return {"x": x, "labels": labels, "mask": jnp.asarray(mask)}


def _masked_ce(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])


NET, TX = _Tiny(), optax.adam(1e-2)


def _lm_state():
    params = NET.init(jax.random.key(0), _lm_batch()["x"], train=False)
    return params, TX.init(params), jax.random.key(7)


def _lm_step(state, batch):
    """An LM fine-tuning step: dropout keyed from the state, a padding-masked mean."""
    params, opt_state, key = state
    key, dropout_key = jax.random.split(key)

    def loss_fn(p):
        return _masked_ce(NET.apply(p, batch["x"], rngs={"dropout": dropout_key}), batch)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, key), loss


def _compare(step, state, batch, cluster, steps=2, **options):
    reference = jax.jit(step)
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(cluster), **options)
    ref_state = par_state = state
    for i in range(steps):
        ref_state, ref_out = reference(ref_state, batch)
        par_state, par_out = parallel(par_state, batch)
        assert_close(par_out, ref_out, f"outputs, step {i}")
        assert_close(par_state, ref_state, f"state after step {i}")
    return parallel


@pytest.mark.parametrize("cluster,microbatches", [(TWO, 1), (TWO, 4), (THREE, 2), (THREE, 4)])
def test_dropout_and_masked_loss_match_jit(cluster, microbatches):
    parallel = _compare(_lm_step, _lm_state(), _lm_batch(), cluster, num_microbatches=microbatches, num_stages=len(cluster))
    assert parallel.plan.num_stages == len(cluster)


def test_dropout_masks_are_jits_bit_for_bit():
    """Each microbatch gets the slice of the bits jax.jit draws for the full batch:
    the step returns its (per-example) masks, which hetpar lays end to end."""

    def step(key, batch):
        keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
        return jax.random.split(key)[0], (keep, jnp.sum(jnp.where(keep, batch["x"], 0.0)))

    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(THREE), num_microbatches=4, num_stages=1)
    key, batch = jax.random.key(3), _lm_batch()
    (_, (masks, total)), (_, (ref_masks, ref_total)) = parallel(key, batch), jax.jit(step)(key, batch)
    np.testing.assert_array_equal(np.asarray(masks), np.asarray(ref_masks))
    per_microbatch = np.asarray(masks).reshape(4, -1)
    assert len({row.tobytes() for row in per_microbatch}) == 4  # no microbatch reuses another's mask
    assert_close(total, ref_total, "sum of kept values")


def test_masked_loss_with_a_microbatch_of_padding_only():
    batch = _lm_batch(lengths=(6, 5, 0, 0, 2, 1, 6, 3))  # microbatch 1 of 4 has no real token
    net = _Tiny(dropout=0.0)

    def step(params, batch):
        loss, grads = jax.value_and_grad(lambda p: _masked_ce(net.apply(p, batch["x"]), batch))(params)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

    params = net.init(jax.random.key(0), batch["x"], train=False)
    _compare(step, params, batch, THREE, num_microbatches=4, num_stages=3)


def test_marked_masked_loss_is_the_documented_per_microbatch_mean():
    """hetpar.value_and_grad averages per-microbatch results by definition (classic
    gradient accumulation), so a masked mean under it is the mean of the microbatches'
    masked means; unmarked jax.value_and_grad is the exact full-batch one."""
    batch = _lm_batch()
    net = _Tiny(dropout=0.0)
    params = net.init(jax.random.key(0), batch["x"], train=False)
    loss_fn = lambda p, b: _masked_ce(net.apply(p, b["x"]), b)  # noqa: E731

    def marked(params, batch):
        return hetpar.value_and_grad(loss_fn)(params, batch)[0]

    parallel = hetpar.parallelize(marked, cluster=hetpar.Cluster.virtual(TWO), num_microbatches=2, num_stages=2)
    halves = [jax.tree.map(lambda a: a[i * 4 : (i + 1) * 4], batch) for i in range(2)]
    expected = np.mean([float(loss_fn(params, h)) for h in halves])
    assert_close(parallel(params, batch), expected, "marked masked loss")
    assert abs(expected - float(loss_fn(params, batch))) > 1e-4  # the two really differ here


def _mixed_precision_step(dtype):
    """f32 parameters, compute in `dtype` (the usual bf16 recipe): the gradients' batch
    reductions are `dtype` matmuls, cast to f32 afterwards."""
    class Cast(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.relu(nn.Dense(64, dtype=dtype, name=f"Block_{i}")(x))
            return nn.Dense(5, dtype=dtype, name="head")(x)

    model = Cast()

    def step(params, batch):
        def loss_fn(p):
            return _masked_ce(model.apply(p, batch["x"]).astype(jnp.float32), batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return loss, grads

    return model, step


def _gaps(a, b):
    """Per leaf (loss, each gradient): the relative L2 distance to the f32 result."""
    return np.array([
        np.linalg.norm(np.asarray(x, np.float32) - np.asarray(y)) / np.linalg.norm(np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    ])


def test_bf16_accumulates_in_f32_within_jits_own_gap():
    batch = {**_lm_batch(), "x": jax.random.normal(jax.random.key(1), (32, T, 8))}
    batch["labels"] = jax.random.randint(jax.random.key(2), (32, T), 0, 5)
    batch["mask"] = jnp.tile(batch["mask"], (4, 1))
    model, bf16_step = _mixed_precision_step(jnp.bfloat16)
    _, f32_step = _mixed_precision_step(jnp.float32)
    params = model.init(jax.random.key(0), batch["x"])
    exact = jax.jit(f32_step)(params, batch)
    jit_bf16 = jax.jit(bf16_step)(params, batch)
    jit_gap = _gaps(jit_bf16, exact)
    parallel = hetpar.parallelize(bf16_step, cluster=hetpar.Cluster.virtual(THREE), num_microbatches=8, num_stages=3)
    result = parallel(params, batch)
    assert [x.dtype for x in jax.tree.leaves(result)] == [x.dtype for x in jax.tree.leaves(jit_bf16)]
    hetpar_gap = _gaps(result, exact)
    assert np.all(jit_gap > 0) and np.all(jit_gap < 0.2)  # bf16 really is coarser than f32 here
    assert np.all(hetpar_gap <= jit_gap + 1e-6), (hetpar_gap, jit_gap)

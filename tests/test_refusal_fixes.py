"""Every refusal's suggested fix, followed to a passing run (issue 14, item 4).
With one microbatch nothing is combined, so what microbatches would refuse runs whole."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetpar
from parity import assert_close

THREE = {"A100": 2, "V100": 2, "cpu": 2}


def _data(batch=8):
    return {"x": jax.random.normal(jax.random.key(1), (batch, 8)), "y": jax.random.normal(jax.random.key(2), (batch, 4))}


W = {"a": jax.random.normal(jax.random.key(3), (8, 16)) * 0.3, "b": jax.random.normal(jax.random.key(4), (16, 4)) * 0.3}


def _sgd(loss_fn):
    def step(w, batch):
        loss, g = jax.value_and_grad(loss_fn)(w, batch)
        return jax.tree.map(lambda p, d: p - 0.1 * d, w, g), loss

    return step


def _forward(w, x):
    return jnp.tanh(x @ w["a"]) @ w["b"]


def _batch_norm_loss(w, batch):
    h = batch["x"] @ w["a"]
    h = (h - h.mean(axis=0)) / (h.std(axis=0) + 1e-5)  # statistics over the batch
    return jnp.mean((jnp.tanh(h) @ w["b"] - batch["y"]) ** 2)


def _worst_two_loss(w, batch):
    per_example = jnp.mean((_forward(w, batch["x"]) - batch["y"]) ** 2, axis=1)
    return jnp.sum(jnp.sort(per_example)[-2:])  # the two hardest examples: no per-microbatch combine


def _run(step, microbatches, num_stages=3, steps=2, args=(W,), **options):
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(THREE), num_microbatches=microbatches,
                                  num_stages=num_stages, **options)
    ref_state = par_state = args[0]
    for i in range(steps):
        ref_state, ref_out = jax.jit(step)(ref_state, _data())
        par_state, par_out = parallel(par_state, _data())
        assert_close(par_out, ref_out, f"outputs, step {i}")
        assert_close(par_state, ref_state, f"state, step {i}")
    return parallel


@pytest.mark.parametrize("loss_fn", [_batch_norm_loss, _worst_two_loss], ids=["batch_norm", "sort"])
def test_refused_with_microbatches_runs_with_one(loss_fn):
    step = _sgd(loss_fn)
    with pytest.raises(hetpar.UnsupportedStepError, match="num_microbatches=1") as refusal:
        _run(step, microbatches=2)
    assert "operator" in str(refusal.value)
    assert f"test_refusal_fixes.py:" in str(refusal.value) and loss_fn.__name__ in str(refusal.value)  # the user's line
    _run(step, microbatches=1)  # the fix the message offers


def test_one_microbatch_refuses_data_parallel_replicas_clearly():
    with pytest.raises(hetpar.PlanError, match="leave num_replicas unset"):
        _run(_sgd(_batch_norm_loss), microbatches=1, num_stages=1, num_replicas=2)


def test_scatter_add_into_nonzero_fix():
    def bins(offset_first):
        def loss_fn(w, batch):
            per_example = jnp.mean((_forward(w, batch["x"]) - batch["y"]) ** 2, axis=1)
            slot = (batch["x"][:, 0] > 0).astype(jnp.int32)
            if offset_first:
                totals = jnp.ones(2).at[slot].add(per_example)
            else:  # the fix: add into zeros, add the operand afterwards
                totals = jnp.zeros(2).at[slot].add(per_example) + jnp.ones(2)
            return jnp.sum(totals * jnp.array([1.0, 2.0]))
        return _sgd(loss_fn)

    with pytest.raises(hetpar.UnsupportedStepError, match="Add into zeros"):
        _run(bins(True), microbatches=2)
    _run(bins(False), microbatches=2)
    _run(bins(True), microbatches=1)


def test_shape_dependent_control_flow_fix():
    def loss_fn(w, batch, branch_on_shape):
        err = (_forward(w, batch["x"]) - batch["y"]) ** 2
        if branch_on_shape and batch["x"].shape[0] < 12:
            return jnp.mean(err) * 2.0
        return jnp.mean(err) * jnp.where(batch["x"].shape[0] < 12, 2.0, 1.0) if branch_on_shape else jnp.mean(err) * 2.0

    with pytest.raises(hetpar.UnsupportedStepError, match="jnp.where or jax.lax.cond"):
        _run(_sgd(lambda w, b: loss_fn(w, b, True)), microbatches=2)
    _run(_sgd(lambda w, b: loss_fn(w, b, False)), microbatches=2)


def test_captured_batch_sized_constant_fix():
    weights = np.linspace(0.5, 1.5, 8).astype(np.float32)  # one per example

    def captured(w, batch):  # built with numpy from the batch shape: a constant to JAX
        here = np.linspace(0.5, 1.5, batch["x"].shape[0]).astype(np.float32)
        return jnp.mean(jnp.mean((_forward(w, batch["x"]) - batch["y"]) ** 2, axis=1) * here)

    def passed_in(w, batch):
        return jnp.mean(jnp.mean((_forward(w, batch["x"]) - batch["y"]) ** 2, axis=1) * batch["weight"])

    with pytest.raises(hetpar.UnsupportedStepError, match="pass it in the batch"):
        _run(_sgd(captured), microbatches=2)
    step = _sgd(passed_in)
    batch = {**_data(), "weight": jnp.asarray(weights)}
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(THREE), num_microbatches=2, num_stages=3)
    assert_close(parallel(W, batch), jax.jit(step)(W, batch), "per-example weights in the batch")


@pytest.mark.parametrize("microbatches", [1, 4])
def test_per_example_outputs_come_back_whole(microbatches):
    """Returning per-example values (predictions) needs no combining: the
    microbatches' pieces are laid end to end."""

    def step(w, batch):
        (loss, preds), g = jax.value_and_grad(
            lambda w: (jnp.mean(((p := _forward(w, batch["x"])) - batch["y"]) ** 2), p), has_aux=True)(w)
        return jax.tree.map(lambda a, d: a - 0.1 * d, w, g), (loss, preds)

    _run(step, microbatches=microbatches)


def test_scan_over_time_refused_with_microbatches_runs_with_one():
    """A scan over time (an RNN: weights as the loop's constants, the batch as its
    scanned inputs) stays one operator; its weight gradients are sums the loop keeps
    inside, so it is refused with microbatches and runs whole with one. A scan over
    layers is split instead (test_scan_layers.py)."""
    w = {"x": W["a"][:2, :8], "h": W["a"][:, :8] * 0.5, "o": W["b"][:8]}

    def rnn_loss(w, batch):
        xs = batch["x"].reshape(-1, 4, 2).transpose(1, 0, 2)  # time, batch, features
        h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(x @ w["x"] + h @ w["h"]), None), jnp.zeros((xs.shape[1], 8)), xs)
        return jnp.mean((h @ w["o"] - batch["y"]) ** 2)

    step = _sgd(rnn_loss)
    with pytest.raises(hetpar.UnsupportedStepError, match="scan loop.*over time.*num_microbatches=1"):
        _run(step, microbatches=2, num_stages=2, args=(w,))
    _run(step, microbatches=1, num_stages=2, args=(w,))

"""A parallelized step is called like `jax.jit(step)` (issue 14, item 8): keyword
arguments, static_argnums, donate_argnums, pytrees of any structure."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

import hetpar
from parity import assert_close

THREE = {"A100": 2, "V100": 2, "cpu": 2}


class State(NamedTuple):
    layers: list  # [(kernel, bias), ...]
    extra: dict  # {"count": int32 scalar, "unused": None}


def _state():
    keys = jax.random.split(jax.random.key(0), 3)
    layers = [(jax.random.normal(k, (8, 8)) * 0.4, jnp.zeros(8)) for k in keys]
    return State(layers, {"count": jnp.zeros((), jnp.int32), "unused": None})


def _batch(size=8):
    return {"x": jax.random.normal(jax.random.key(1), (size, 8)), "y": jax.random.normal(jax.random.key(2), (size, 8))}


def _loss(layers, batch, train=True):
    h = batch["x"]
    for w, b in layers:
        h = jnp.tanh(h @ w + b)
        if train:
            h = h * 1.5
    return jnp.mean((h - batch["y"]) ** 2)


def step(state, batch, train=True, *, lr):
    loss, grads = jax.value_and_grad(_loss)(state.layers, batch, train)
    layers = jax.tree.map(lambda p, g: p - lr * g, state.layers, grads)
    return State(layers, {"count": state.extra["count"] + 1, "unused": None}), {"loss": loss}


def _parallel(**options):
    return hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(THREE), num_microbatches=2, num_stages=3, **options)


def test_keywords_statics_and_pytrees_match_jit():
    parallel = _parallel(static_argnums=2)
    reference = jax.jit(step, static_argnums=2)
    lr = jnp.float32(0.1)
    for train in (True, False):
        expected = reference(_state(), _batch(), train, lr=lr)
        assert_close(parallel(_state(), batch=_batch(), train=train, lr=lr), expected, f"train={train}")
    assert parallel.cache_size() == 2  # one plan per static value, as jax.jit compiles per value
    assert_close(parallel(_state(), _batch(), True, lr=lr), reference(_state(), _batch(), True, lr=lr), "positional")
    assert parallel.cache_size() == 2


def test_unhashable_static_argument_is_refused():
    with pytest.raises(hetpar.HetparError, match="hashable"):
        _parallel(static_argnums=2)(_state(), _batch(), [True], lr=0.1)


def test_donated_state_is_freed_only_after_a_successful_step():
    parallel = _parallel(donate_argnums=0)
    state = _state()
    with pytest.raises(hetpar.PlanError, match="not divisible"):
        parallel(state, _batch(size=9), lr=0.1)  # fails while planning
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # the caller's state survives
    expected = jax.jit(step)(_state(), _batch(), lr=0.1)
    new_state, metrics = parallel(state, _batch(), lr=0.1)
    assert_close((new_state, metrics), expected, "donated step")
    assert all(x.is_deleted() for x in jax.tree.leaves(state.layers))  # memory given back


def test_new_batch_shape_replans():
    parallel = _parallel()
    for size in (8, 16):
        assert_close(parallel(_state(), _batch(size), lr=0.1), jax.jit(step)(_state(), _batch(size), lr=0.1), f"batch {size}")
    assert parallel.cache_size() == 2


def test_outputs_keep_jits_types_constants_and_weak_scalars_included():
    from models import mlp

    w = mlp.setup(batch_size=8)

    def step(state, batch):
        new, loss = w.step(state, batch)  # a constant Python scalar, a numpy one, and a weak product below
        return new, loss, 0.5, loss * 2.0, jnp.float32(3.0), batch["x"].shape[0] * 1.0

    ref = jax.jit(step)(w.state, w.batch)
    par = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual({"A100": 4, "V100": 4}), num_stages=2,
                             num_microbatches=2)(w.state, w.batch)
    for i, (r, p) in enumerate(zip(ref[1:], par[1:]), start=1):
        assert isinstance(p, jax.Array), (i, type(p))
        assert (p.dtype, p.weak_type, p.shape) == (r.dtype, r.weak_type, r.shape), i
        assert_close(p, r, f"output {i}")

"""Operator costs agree with XLA's cost analysis.

The predictor is calibrated against compiled programs, so hetpar's FLOP count has to
be XLA's: these tests compare `graph_flops(trace(f, *args))` with
`jax.jit(f).lower(*args).cost_analysis()["flops"]`, whole programs within 5% and
single primitives exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from hetpar.trace import jaxpr_ir
from hetpar.trace.flops import OpCost, graph_flops, op_bytes, op_costs, op_flops
from models import gpt

Case = tuple[Callable, tuple[Any, ...]]


def xla_flops(fn: Callable, *args: Any) -> float:
    """XLA's count for the unpartitioned program; the key is absent when it is zero."""
    return jax.jit(fn).lower(*args).cost_analysis().get("flops", 0.0)


def ours(fn: Callable, *args: Any) -> float:
    return graph_flops(jaxpr_ir.trace(fn, *args))


def assert_close(fn: Callable, args: tuple[Any, ...], rel: float = 0.05) -> None:
    mine, xla = ours(fn, *args), xla_flops(fn, *args)
    assert mine == pytest.approx(xla, rel=rel), f"ours {mine:.6g} vs XLA {xla:.6g} ({mine / xla:.4f})"


# --- whole programs ------------------------------------------------------------------


def matmul_chain() -> Case:
    def fn(x, w1, w2, w3):
        return jnp.maximum((x @ w1) @ w2 + 1.0, 0.0) @ w3

    shapes = [(64, 128), (128, 256), (256, 96), (96, 32)]
    return fn, tuple(jnp.ones(s) for s in shapes)


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in (128, 128):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


def mlp_train_step() -> Case:
    model, tx = _MLP(), optax.adamw(1e-3, weight_decay=1e-2)
    x, y = jnp.ones((32, 64)), jnp.arange(32) % 10
    params = model.init(jax.random.key(0), x)
    opt_state = tx.init(params)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, x, y)


def _layer_norm(x: jax.Array, g: jax.Array) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    return g * (x - mu) * lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def transformer_block() -> Case:
    """Pre-norm attention and MLP with softmax, layer norm and both GELUs, under grad."""

    def block(p, x):
        h = _layer_norm(x, p["g1"])
        q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
        mask = jnp.tril(jnp.ones(scores.shape[-2:], bool))
        attn = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        x = x + jnp.einsum("bqk,bkd->bqd", attn, v) @ p["wo"]
        h = _layer_norm(x, p["g2"])
        up = h @ p["w1"]
        h = jax.nn.gelu(up, approximate=True) + jax.nn.gelu(up, approximate=False)
        return x + h @ p["w2"]

    def loss(p, x):
        return jnp.mean(block(p, block(p, x)) ** 2)

    d = 64
    p = {name: jnp.full((d, d), 0.01) for name in ("wq", "wk", "wv", "wo")}
    p |= {"w1": jnp.full((d, 4 * d), 0.01), "w2": jnp.full((4 * d, d), 0.01), "g1": jnp.ones(d), "g2": jnp.ones(d)}
    return jax.value_and_grad(loss), (p, jnp.ones((4, 32, d)))


def conv_net() -> Case:
    """Strided SAME conv, dilated conv and a depthwise conv, with both gradients (the
    backward convs dilate their input and group their batch)."""
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(ks, x):
        x = lax.conv_general_dilated(x, ks[0], (2, 2), "SAME", dimension_numbers=dn)
        x = jnp.tanh(lax.conv_general_dilated(x, ks[1], (1, 1), "VALID", rhs_dilation=(2, 2), dimension_numbers=dn))
        x = lax.conv_general_dilated(x, ks[2], (1, 1), ((1, 1), (1, 1)), dimension_numbers=dn, feature_group_count=16)
        return (x**2).sum()

    ks = (jnp.full((3, 3, 8, 16), 0.1), jnp.full((3, 3, 16, 16), 0.1), jnp.full((3, 3, 1, 16), 0.1))
    return jax.grad(loss, argnums=(0, 1)), (ks, jnp.ones((4, 32, 32, 8)))


def _scan_over_matmuls(unroll: bool) -> Case:
    ws = jnp.full((6, 64, 64), 0.01)

    def loss(ws, x):
        def body(h, w):
            return jnp.tanh(h @ w) + h, (h**2).sum()

        h, sq = lax.scan(body, x, ws, unroll=unroll)
        return h.sum() + sq.sum()

    # Gradients for both arguments: with x's left out, the unrolled program drops the
    # last iteration's carry gradient as dead code, which a rolled loop cannot do.
    return jax.value_and_grad(loss, argnums=(0, 1)), (ws, jnp.ones((32, 64)))


def checkpointed_grad() -> Case:
    @jax.jit
    def layer(w, x):
        return jax.nn.gelu(x @ w)

    def loss(w, x):
        return jax.checkpoint(lambda x: layer(w, layer(w, x)))(x).mean()

    return jax.grad(loss), (jnp.full((128, 128), 0.01), jnp.ones((64, 128)))


def dropout_train_step() -> Case:
    """flax Dropout draws its mask with threefry, about 38 FLOPs per element as XLA
    counts them: more than the layer's other elementwise work."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, train: bool) -> jax.Array:
            x = nn.Dropout(0.1, deterministic=not train)(nn.gelu(nn.Dense(256)(x)))
            return nn.Dense(10)(x)

    net, x = Net(), jnp.ones((64, 128))
    params = net.init(jax.random.key(0), x, train=False)

    def grad_step(params, x, key):
        return jax.grad(lambda p: (net.apply(p, x, train=True, rngs={"dropout": key}) ** 2).mean())(params)

    return grad_step, (params, x, jax.random.key(1))


def gpt_train_step() -> Case:
    w = gpt.setup(batch_size=8)
    return w.step, (w.state, w.batch)


@pytest.mark.parametrize(
    "make",
    [matmul_chain, mlp_train_step, transformer_block, conv_net, checkpointed_grad, dropout_train_step, gpt_train_step],
)
def test_program_flops_agree_with_xla_within_5_percent(make: Callable[[], Case]) -> None:
    fn, args = make()
    assert_close(fn, args)


def test_scan_counts_its_body_times_its_length() -> None:
    # XLA counts a rolled loop's body once; the same scan unrolled shows the real work.
    fn, args = _scan_over_matmuls(unroll=False)
    unrolled, _ = _scan_over_matmuls(unroll=True)
    assert ours(fn, *args) == pytest.approx(xla_flops(unrolled, *args), rel=0.05)
    assert ours(fn, *args) > 5 * xla_flops(fn, *args)


def test_while_counts_its_body_once_like_xla() -> None:
    def fn(w, x, n):
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]

    args = (jnp.ones((64, 64)), jnp.ones((16, 64)), 10)
    assert ours(fn, *args) == pytest.approx(xla_flops(fn, *args), rel=1e-6)


def test_cond_counts_its_most_expensive_branch() -> None:
    def fn(i, x):
        return lax.switch(i, [lambda x: x + 1.0, lambda x: (x @ x) @ x, lambda x: x @ x], x)

    args = (1, jnp.ones((32, 32)))
    assert ours(fn, *args) == pytest.approx(xla_flops(fn, *args), rel=1e-6)


# --- single primitives, exactly ----------------------------------------------------

_X = jnp.linspace(0.1, 0.9, 64 * 48).reshape(64, 48)
_I = jnp.arange(64 * 48, dtype=jnp.int32).reshape(64, 48)
_PRIMITIVES: dict[str, Case] = {
    "add": (lambda a: a + a, (_X,)),
    "convert": (lambda a: a.astype(jnp.bfloat16), (_X,)),
    "bitcast": (lambda a: lax.bitcast_convert_type(a, jnp.int32), (_X,)),
    "select_n bool": (lambda a: jnp.where(a > 0.5, a, -a), (_X,)),
    "select_n int": (lambda i, a: lax.select_n(i, a, 2 * a, 3 * a), (_I % 3, _X)),
    "exp": (jnp.exp, (_X,)),
    "tanh bf16": (jnp.tanh, (_X.astype(jnp.bfloat16),)),
    "logistic": (jax.nn.sigmoid, (_X,)),
    "erf_inv bf16": (lax.erf_inv, (_X.astype(jnp.bfloat16),)),
    "lgamma": (lax.lgamma, (_X,)),
    "pow": (lax.pow, (_X, _X)),
    "pow int exponent": (lax.pow, (_X, _I)),
    "integer_pow 7": (lambda a: a**7, (_X,)),
    "integer_pow -2": (lambda a: a**-2, (_X,)),
    "reduce_sum": (lambda a: a.sum(0), (_X,)),
    "argmax": (lambda a: jnp.argmax(a, 1), (_X,)),
    "argmin int": (lambda i: jnp.argmin(i, 0), (_I,)),
    "cumsum": (lambda a: jnp.cumsum(a, 1), (_X,)),
    "cumlogsumexp": (lambda a: lax.cumlogsumexp(a, 0), (_X,)),
    "sort": (lambda a: jnp.sort(a, 1), (_X,)),
    "scatter-add": (lambda a: a.at[jnp.array([1, 5, 9])].add(1.0), (_X,)),
    "scatter-max": (lambda a: a.at[jnp.array([1, 5, 9])].max(0.5), (_X,)),
    "max pool": (lambda a: lax.reduce_window(a, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID"), (_X,)),
    "max pool grad": (
        jax.grad(lambda a: lax.reduce_window(a, -jnp.inf, lax.max, (3, 3), (2, 2), "SAME").sum()),
        (_X,),
    ),
    "variadic reduce_window": (
        lambda a: lax.reduce_window((a, a), (0.0, 1.0), lambda x, y: (x[0] + y[0], x[1] * y[1]), (2, 2), (1, 1), "VALID"),
        (_X,),
    ),
    "random bits": (lambda k: jax.random.bits(k, (64, 48)), (jax.random.key(0),)),
    "data movement": (
        lambda a: jnp.concatenate([a.T.reshape(48, 64), lax.pad(a, np.float32(0), ((0, 0, 0), (8, 8, 1))).T[:, :64]]),
        (_X,),
    ),
    "x + 0 and x * 1 fold": (lambda a: (a + 0.0) * 1.0 + jnp.zeros_like(a), (_X,)),
    "constants fold": (lambda a: a + jnp.exp(jnp.full(a.shape, 2.0)) * 3.0, (_X,)),
}


@pytest.mark.parametrize("name", list(_PRIMITIVES))
def test_primitive_flops_match_xla_exactly(name: str) -> None:
    fn, args = _PRIMITIVES[name]
    assert ours(fn, *args) == pytest.approx(xla_flops(fn, *args), rel=1e-6, abs=0.5)


def test_dot_general_is_2_batch_m_n_k() -> None:
    lhs, rhs = jax.ShapeDtypeStruct((3, 5, 7), jnp.float32), jax.ShapeDtypeStruct((3, 7, 11), jnp.float32)
    out = jax.ShapeDtypeStruct((3, 5, 11), jnp.float32)
    params = {"dimension_numbers": (((2,), (1,)), ((0,), (0,)))}
    assert op_flops("dot_general", [lhs, rhs], [out], params) == 2 * 3 * 5 * 11 * 7


def test_op_costs_carry_bytes_in_and_out() -> None:
    graph = jaxpr_ir.trace(lambda x, w: (x @ w).astype(jnp.bfloat16), jnp.ones((4, 8)), jnp.ones((8, 2)))
    matmul, convert = op_costs(graph)
    assert matmul == OpCost(flops=2 * 4 * 2 * 8, bytes_in=(32 + 16) * 4, bytes_out=8 * 4)
    assert convert == OpCost(flops=8, bytes_in=8 * 4, bytes_out=8 * 2)
    op = graph.ops[0]
    assert op_bytes([graph.avals[v] for v in op.inputs], [graph.avals[v] for v in op.outputs]) == (192, 32)

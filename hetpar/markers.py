"""Explicit gradient-accumulation markers, for steps the automatic analysis refuses.

`hetpar.value_and_grad(loss_fn)` computes exactly what `jax.value_and_grad` does. It
also tags its results, so that under `hetpar.parallelize` the loss function runs on
each microbatch and its value and gradients are averaged over microbatches: classic
gradient accumulation. For a loss that is a mean over examples this equals the
full-batch result; for others (batch statistics, a loss that is not a mean) it is the
usual microbatched approximation, chosen explicitly by the user.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

MARKER_SCOPE = "hetpar_accumulate"


def _mark(tree: Any) -> Any:
    # One barrier per leaf, so each gradient stays with the layer that produced it.
    with jax.named_scope(MARKER_SCOPE):
        return jax.tree.map(lambda x: jax.lax.optimization_barrier(x), tree)


def value_and_grad(fun: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False, **kwargs: Any) -> Callable:
    """Like `jax.value_and_grad`; marks the value (and aux) and gradients as the
    quantities to average over microbatches."""
    inner = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    def wrapped(*args: Any, **kw: Any) -> Any:
        value, grads = inner(*args, **kw)
        return _mark(value), _mark(grads)

    return wrapped


def grad(fun: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False, **kwargs: Any) -> Callable:
    """Like `jax.grad`, with the marking of `value_and_grad`."""
    inner = value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    def wrapped(*args: Any, **kw: Any) -> Any:
        value, grads = inner(*args, **kw)
        return (grads, value[1]) if has_aux else grads

    return wrapped

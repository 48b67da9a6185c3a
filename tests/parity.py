"""Shared parity check: a hetpar step against `jax.jit(step)` on one device."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import hetpar

# fp32, the tolerance the issue starts from: microbatching only reorders sums.
RTOL, ATOL = 1e-5, 1e-6


def with_grads(loss_fn):
    """An unmodified-style step that also returns the gradients, so parity covers them."""

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss, grads

    return step


def assert_close(actual: Any, expected: Any, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    flat_a, tree_a = jax.tree.flatten(actual)
    flat_e, tree_e = jax.tree.flatten(expected)
    assert tree_a == tree_e, f"{what}: tree structure differs"
    for path, a, e in zip(jax.tree_util.tree_flatten_with_path(expected)[0], flat_a, flat_e):
        a, e = _plain(a), _plain(e)
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
            err_msg=f"{what} at {jax.tree_util.keystr(path[0])}",
        )


def _plain(x: Any) -> Any:
    """Typed PRNG keys compare by their key data."""
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def run_parity(workload, cluster: hetpar.Cluster, steps: int = 3, **options: Any) -> hetpar.Plan:
    """Runs `steps` steps both ways from the same state; compares loss, gradients and
    the new parameters after every step. Returns the plan hetpar used."""
    step = with_grads(workload.loss_fn)
    reference = jax.jit(step)
    parallel = hetpar.parallelize(step, cluster=cluster, **options)
    ref_state = par_state = workload.state
    for i in range(steps):
        ref_state, ref_loss, ref_grads = reference(ref_state, workload.batch)
        par_state, par_loss, par_grads = parallel(par_state, workload.batch)
        assert_close(par_loss, ref_loss, f"loss, step {i}")
        assert_close(par_grads, ref_grads, f"gradients, step {i}")
        assert_close(par_state.params, ref_state.params, f"parameters after step {i}")
        assert_close(par_state.opt_state, ref_state.opt_state, f"optimizer state after step {i}")
    return parallel.plan


def assert_reads_in_place(evaluate: Any, params: Any) -> None:
    """Every program of `evaluate`'s last call reads each parameter where and as it
    lies (no copy to another mesh or layout), on the stage the training plan put it."""
    from hetpar.runtime.communicator import already_there

    compiled = evaluate.compiled()
    leaves = dict(zip(compiled.graph.invars, jax.tree.leaves(params)))
    read = 0
    for program in compiled.programs:
        for v, sharding in zip(program.task.inputs, program.in_shardings):
            if v in leaves:
                assert already_there(leaves[v], sharding), (program.task.name, leaves[v].sharding, sharding)
                read += 1
    assert read >= len(leaves)

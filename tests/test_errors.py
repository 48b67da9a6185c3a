"""Bad input gets a clear error naming the problem and the fix, not a JAX traceback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetpar


def _step(w, batch):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
    return w - 0.1 * g, loss


W = jnp.ones((8, 4))
BATCH = {"x": jnp.ones((12, 8))}


def test_batch_not_divisible_by_microbatches():
    step = hetpar.parallelize(_step, cluster=hetpar.Cluster.virtual({"A100": 8}), num_microbatches=5)
    with pytest.raises(hetpar.PlanError, match=r"batch size 12 is not divisible by num_microbatches=5.*e\.g\. 4\)"):
        step(W, BATCH)


def test_more_stages_than_layers():
    step = hetpar.parallelize(_step, cluster=hetpar.Cluster.virtual({"A100": 4, "V100": 4}), num_stages=8)
    with pytest.raises(hetpar.PlanError, match="8 layers|ask for fewer|need at least 8 layers"):
        step(W, BATCH)


def test_unknown_device_type():
    with pytest.raises(hetpar.ClusterError, match=r"unknown device type 'B300'.*known types: .*A100"):
        hetpar.Cluster.virtual({"B300": 4})


def test_more_devices_than_exist():
    with pytest.raises(hetpar.ClusterError, match=r"asks for 12 devices but this process sees 8.*jax_num_cpu_devices"):
        hetpar.Cluster.virtual({"A100": 8, "V100": 4})


def test_non_positive_device_count():
    with pytest.raises(hetpar.ClusterError, match="positive integer"):
        hetpar.Cluster.virtual({"A100": 0})


def test_invalid_microbatch_count():
    with pytest.raises(hetpar.PlanError, match="num_microbatches: Input should be greater than or equal to 1 \\(got 0\\)"):
        hetpar.parallelize(_step, cluster=hetpar.Cluster.virtual({"A100": 8}), num_microbatches=0)


def test_batch_leaves_of_different_sizes():
    step = hetpar.parallelize(_step, cluster=hetpar.Cluster.virtual({"A100": 8}))
    with pytest.raises(hetpar.HetparError, match="same leading batch dimension"):
        step(W, {"x": jnp.ones((12, 8)), "y": jnp.ones((6,))})


def test_plan_before_first_call():
    step = hetpar.parallelize(_step, cluster=hetpar.Cluster.virtual({"A100": 8}))
    with pytest.raises(hetpar.HetparError, match="first call"):
        step.plan


def test_per_example_output_comes_back_whole():
    """Per-example outputs need no combining: the microbatches' pieces, end to end."""
    def step(w, batch):
        return w, batch["x"] @ w

    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual({"A100": 8}), num_microbatches=2)
    np.testing.assert_allclose(np.asarray(parallel(W, BATCH)[1]), np.asarray(jax.jit(step)(W, BATCH)[1]), rtol=1e-5, atol=1e-6)


def test_microbatch_of_one_example_that_changes_the_program():
    from models import gpt

    w = gpt.setup(batch_size=4)
    step = hetpar.parallelize(w.step, cluster=hetpar.Cluster.virtual({"A100": 8}), num_microbatches=4)
    with pytest.raises(hetpar.UnsupportedStepError, match="microbatch size 1.*fewer microbatches or a larger batch"):
        step(w.state, w.batch)
    fewer = hetpar.parallelize(w.step, cluster=hetpar.Cluster.virtual({"A100": 8}), num_microbatches=2)  # the fix
    np.testing.assert_allclose(float(fewer(w.state, w.batch)[1]), float(jax.jit(w.step)(w.state, w.batch)[1]), rtol=1e-5)

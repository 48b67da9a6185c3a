"""One runtime core, every runtime: the same parity cases (interleaved chunks, dropout
keyed from the state, ZeRO-3) on the in-process runtime and on Ray actors, against
`jax.jit(step)` on one device. The jax.distributed runtime runs the same three in one
multi-process launch (tests/test_distributed.py, `matrix`).

Ray cases share one local Ray instance (loopback only). The steps are made inside
functions, so Ray sends them to its workers by value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import hetpar
from hetpar.options import ShardingOption, StageOption
from models import gpt, mlp
from parity import assert_close, run_parity

TWO_TYPES = {"A100": 4, "V100": 4}
RUNTIMES = ["local", "ray"]


@pytest.fixture(scope="module")
def runtime(request):
    if request.param == "ray":
        hetpar.init(num_cpus=2)
        yield "ray"
        hetpar.shutdown()
    else:
        yield request.param


def dropout_case():
    """A step whose dropout key lives in the state (a typed PRNG key) and whose
    dropout bits are drawn for the whole batch, sliced per microbatch."""
    import flax.linen as nn
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.relu(nn.Dense(16, name=f"Block_{i}")(x))
                x = nn.Dropout(0.3, deterministic=False)(x)
            return nn.Dense(4, name="head")(x)

    net, tx = Net(), optax.adam(1e-2)
    x = jax.random.normal(jax.random.key(1), (8, 8))
    y = jax.random.normal(jax.random.key(2), (8, 4))
    params = net.init({"params": jax.random.key(0), "dropout": jax.random.key(0)}, x)

    def step(state, batch):
        params, opt_state, key = state
        key, dropout_key = jax.random.split(key)
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((net.apply(p, batch["x"], rngs={"dropout": dropout_key}) - batch["y"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    return step, (params, tx.init(params), jax.random.key(7)), {"x": x, "y": y}


@pytest.mark.parametrize("runtime", RUNTIMES, indirect=True)
def test_interleaved_chunks(runtime):
    w = gpt.setup(batch_size=8, config=gpt.GPTConfig(n_layers=4, d_model=16, n_heads=2, seq_len=8, vocab_size=32))
    plan = run_parity(w, hetpar.Cluster.virtual(TWO_TYPES), steps=2, num_stages=2, num_microbatches=4, num_layers=4,
                      schedule="interleaved", chunks=2, runtime=runtime)
    assert plan.schedule == "interleaved" and plan.num_stages == 4 and plan.chunks == 2
    assert plan.stages[0].device_ids == plan.stages[2].device_ids != plan.stages[1].device_ids


@pytest.mark.parametrize("runtime", RUNTIMES, indirect=True)
def test_dropout(runtime):
    step, state, batch = dropout_case()
    reference = jax.jit(step)
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, num_microbatches=2,
                                  runtime=runtime)
    ref_state = par_state = state
    for i in range(2):
        ref_state, ref_loss = reference(ref_state, batch)
        par_state, par_loss = parallel(par_state, batch)
        assert_close(par_loss, ref_loss, f"loss, step {i}")
        assert_close(par_state, ref_state, f"state after step {i}")
    compiled = parallel.compiled()
    analysis = compiled.step.analysis if runtime == "ray" else compiled.analysis
    assert analysis.sliced, "the dropout bits are not drawn for the whole batch: the case tests nothing"
    assert jax.dtypes.issubdtype(par_state[2].dtype, jax.dtypes.prng_key)  # the key comes back a typed key
    parallel.shutdown()


@pytest.mark.parametrize("runtime", RUNTIMES, indirect=True)
def test_zero3(runtime):
    plan = run_parity(mlp.setup(batch_size=16, hidden=32, depth=3), hetpar.Cluster.virtual(TWO_TYPES), steps=2,
                      num_stages=2, num_layers=4, num_microbatches=2, schedule="1f1b",
                      stage_option=StageOption(mode="uniform"), sharding_option=ShardingOption(zero=3), runtime=runtime)
    for stage in plan.stages:
        assert stage.zero == 3 and stage.gathered, "ZeRO-3 gathered no parameter"
        assert any("data" in spec for _, spec in stage.shardings)

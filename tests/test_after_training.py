"""What users do with a step's results (issue 14, items 6 and 7): evaluate, log
norms and metrics, checkpoint with orbax and resume under another plan."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import hetpar
from parity import assert_close, assert_reads_in_place

THREE = {"A100": 2, "V100": 2, "cpu": 2}
TWO = {"A100": 2, "V100": 2}


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = jnp.tanh(nn.Dense(16, name=f"Block_{i}")(x))
        return nn.Dense(4, name="head")(x)


NET, TX = _Net(), optax.adam(1e-2)


def _batch(i=0):
    return {"x": jax.random.normal(jax.random.key(10 + i), (8, 8)), "y": jax.random.normal(jax.random.key(20 + i), (8, 4))}


def _state():
    params = NET.init(jax.random.key(0), _batch()["x"])
    return {"params": params, "opt_state": TX.init(params)}


def _loss(params, batch):
    return jnp.mean((NET.apply(params, batch["x"]) - batch["y"]) ** 2)


def step(state, batch):
    loss, grads = jax.value_and_grad(_loss)(state["params"], batch)
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, metrics


def _train(state, steps, first=0, **options):
    parallel = hetpar.parallelize(step, **options)
    losses = []
    for i in range(first, first + steps):
        state, metrics = parallel(state, _batch(i))
        losses.append(float(metrics["loss"]))
    return parallel, state, losses


@pytest.fixture(scope="module")
def trained():
    return _train(_state(), 2, cluster=hetpar.Cluster.virtual(THREE), num_microbatches=2, num_stages=3)


def test_outputs_are_usable_after_a_multi_stage_step(trained):
    parallel, state, _ = trained
    ref_state = _state()
    for i in range(2):
        ref_state, ref_metrics = jax.jit(step)(ref_state, _batch(i))
    assert len({p.sharding.mesh for p in jax.tree.leaves(state["params"])}) == 3  # spread over the stages
    _, metrics = parallel(state, _batch(2))
    ref_next, ref_m = jax.jit(step)(ref_state, _batch(2))
    assert_close(metrics["loss"] + metrics["grad_norm"], ref_m["loss"] + ref_m["grad_norm"], "metrics combine directly")
    with pytest.raises(ValueError):  # the documented policy: state stays where its stages are
        optax.global_norm(state["params"])
    gathered = hetpar.gather(state["params"])
    assert_close(optax.global_norm(gathered), optax.global_norm(ref_state["params"]), "norm of gathered params")
    assert_close(jax.jit(_loss)(gathered, _batch(5)), jax.jit(_loss)(ref_state["params"], _batch(5)), "jit eval")
    assert_close(jax.device_get(state), ref_state, "state on the host")
    evaluate = hetpar.parallelize(_loss, like=parallel, batch_argnum=1)
    assert_close(evaluate(state["params"], _batch(5)), jax.jit(_loss)(ref_state["params"], _batch(5)), "eval like the step")


def test_orbax_checkpoint_resumes_under_another_plan(trained, tmp_path):
    _, state, losses = trained
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), state)
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert_close(restored, jax.device_get(state), "restored state")

    _, _, resumed = _train(restored, 2, first=2, cluster=hetpar.Cluster.virtual(TWO), num_microbatches=4, num_stages=2)
    ref_state, uninterrupted = _state(), []
    for i in range(4):
        ref_state, m = jax.jit(step)(ref_state, _batch(i))
        uninterrupted.append(float(m["loss"]))
    np.testing.assert_allclose(losses + resumed, uninterrupted, rtol=1e-5, atol=1e-6)


def _augmented_loss(params, batch):
    """An eval with test-time augmentation: the network runs twice, on x and on -x.
    Planned on its own, its second pass would land on the last stages, away from the
    parameters it reads."""
    flipped = {"x": -batch["x"], "y": batch["y"]}
    return (_loss(params, batch) + _loss(params, flipped)) / 2


@pytest.mark.parametrize("eval_fn", [_loss, _augmented_loss], ids=["loss", "augmented"])
def test_eval_like_the_step_runs_where_the_parameters_are(trained, eval_fn):
    parallel, state, _ = trained
    ref_state = _state()
    for i in range(2):
        ref_state, _ = jax.jit(step)(ref_state, _batch(i))
    evaluate = hetpar.parallelize(eval_fn, like=parallel, batch_argnum=1)
    before = jax.tree.map(lambda p: p.sharding, state["params"])
    assert_close(evaluate(state["params"], _batch(5)), jax.jit(eval_fn)(ref_state["params"], _batch(5)), "eval")
    assert jax.tree.map(lambda p: p.sharding, state["params"]) == before
    assert_reads_in_place(evaluate, state["params"])
    # Its stages are the training plan's, each with the layers whose parameters it holds.
    assert [s.device_ids for s in evaluate.plan.stages] == [s.device_ids for s in parallel.plan.stages]
    assert len(set(evaluate.plan.stage_of_operators(0))) == 3


def test_hetpar_checkpoints_resume_under_another_plan_with_a_key_in_the_state(trained, tmp_path):
    """hetpar.save_checkpoint / restore_checkpoint (the path that also works across
    processes: tests/test_distributed.py): a state with a typed PRNG key in it comes
    back with the key typed, restored against an abstract `like`, and resumes."""
    _, state, losses = trained
    with_key = {**state, "key": jax.random.key(7)}
    hetpar.save_checkpoint(tmp_path / "ckpt", with_key)
    with pytest.raises(hetpar.HetparError, match="a checkpoint already exists .* pass force=True"):
        hetpar.save_checkpoint(tmp_path / "ckpt", with_key)
    restored = hetpar.restore_checkpoint(tmp_path / "ckpt", like=jax.eval_shape(_state) | {"key": jax.random.key(0)})
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    assert_close(jax.random.key_data(restored["key"]), jax.random.key_data(with_key["key"]), "key")
    del restored["key"]
    assert_close(restored, jax.device_get(state), "restored state")
    with pytest.raises(hetpar.HetparError, match="does not match `like`"):
        hetpar.restore_checkpoint(tmp_path / "ckpt", like={"params": jax.eval_shape(_state)["params"]})
    _, _, resumed = _train(restored, 1, first=2, cluster=hetpar.Cluster.virtual(TWO), num_microbatches=2, num_stages=2)
    ref_state = _state()
    for i in range(3):
        ref_state, m = jax.jit(step)(ref_state, _batch(i))
    np.testing.assert_allclose(resumed, [float(m["loss"])], rtol=1e-5)

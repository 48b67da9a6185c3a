"""Compile once, and show it (issue 28, item 6; issue 34, item 1): the second call of
a parallelized step, with the state it returned, compiles no program; a step made
anew (as a restarted process makes it) on a restored checkpoint reads every program
from JAX's persistent cache; compiling logs one line per program; a plan given a
step it was not made for names the first differing argument by its path.

Compilations are counted with `jax.monitoring`: '/jax/core/compile/backend_compile_duration'
is recorded for every executable JAX asks the backend for, a persistent-cache hit
included (which also records '/jax/compilation_cache/cache_hits')."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import hetpar
from hetpar.compile.cache import ENV, default_cache_dir, enable_compilation_cache
from parity import assert_close
from test_after_training import NET, TX  # the same small net and optimizer

TWO = {"A100": 4, "V100": 4}
_COUNTS = {"compiles": 0, "hits": 0}


def _on_duration(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _COUNTS["compiles"] += 1


def _on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        _COUNTS["hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)




def _batch(i=0, features=8):
    return {"x": jax.random.normal(jax.random.key(10 + i), (8, features)), "y": jax.random.normal(jax.random.key(20 + i), (8, 4))}


def _state():
    params = NET.init(jax.random.key(0), _batch()["x"])
    # `step` a Python int, as flax's TrainState starts it: weakly typed on the first call only.
    return {"params": params, "opt_state": TX.init(params), "step": 0}


def step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((NET.apply(p, batch["x"]) - batch["y"]) ** 2))(state["params"])
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state, "step": state["step"] + 1}, loss


OPTIONS = dict(num_stages=2, num_microbatches=2, schedule="1f1b")


@pytest.fixture
def every_program_cached():
    """Programs this small compile in well under JAX's 1 s threshold for writing them."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def test_second_call_and_restored_state_compile_nothing(tmp_path, caplog, every_program_cached):
    train = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO), **OPTIONS)
    with caplog.at_level(logging.INFO, logger="hetpar.compile"):
        before = _COUNTS["compiles"]
        state, _ = train(_state(), _batch(0))
        first = _COUNTS["compiles"] - before
    lines = [r.getMessage() for r in caplog.records if "compiled " in r.getMessage() and "/" in r.getMessage()]
    assert len(lines) >= 2 * 2 and first >= len(lines), (first, lines)  # a line per program; forward and backward per stage
    assert lines[-1].startswith(f"hetpar: compiled {len(lines)}/{len(lines)}: stage ")

    before = _COUNTS["compiles"]
    state2, loss2 = train(state, _batch(1))
    assert _COUNTS["compiles"] == before, f"the second call compiled {_COUNTS['compiles'] - before} programs"
    ref, _ = jax.jit(step)(_state(), _batch(0))
    ref2, ref_loss2 = jax.jit(step)(ref, _batch(1))
    assert_close(loss2, ref_loss2, "second call: loss")
    assert_close(jax.device_get(state2), jax.device_get(ref2), "second call: state")

    # Restored from a checkpoint: the same step compiles nothing; a step made anew, as a
    # restarted process would, reads every program from the persistent cache.
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restored = checkpointer.restore(tmp_path / "ckpt", jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), state))
    before = _COUNTS["compiles"]
    again, loss = train(restored, _batch(1))
    assert _COUNTS["compiles"] == before, f"the restored state compiled {_COUNTS['compiles'] - before} programs"
    assert_close(loss, ref_loss2, "restored: loss")

    assert jax.config.jax_compilation_cache_dir, "parallelize left JAX's persistent cache off"
    restarted = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO), **OPTIONS)
    compiles, hits = _COUNTS["compiles"], _COUNTS["hits"]
    again, loss = restarted(restored, _batch(1))
    compiled, read = _COUNTS["compiles"] - compiles, _COUNTS["hits"] - hits
    assert compiled > 0 and read == compiled, f"{compiled - read} of {compiled} programs compiled, not read from the cache"
    assert_close(loss, ref_loss2, "restarted: loss")


def test_cache_location_and_off_switch(monkeypatch, tmp_path):
    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv(ENV, "0")
        assert enable_compilation_cache() is None
        monkeypatch.setenv(ENV, str(tmp_path / "cache"))
        assert enable_compilation_cache() == str(tmp_path / "cache") == jax.config.jax_compilation_cache_dir
        assert (tmp_path / "cache").is_dir()
        monkeypatch.delenv(ENV)
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert default_cache_dir() == tmp_path / "xdg" / "hetpar" / "jax"
        assert enable_compilation_cache() == str(tmp_path / "xdg" / "hetpar" / "jax")
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))  # the user's own choice stays
        assert enable_compilation_cache() == str(tmp_path / "mine")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert os.environ.get(ENV) is None


def test_a_plan_for_another_step_names_the_argument(tmp_path):
    train = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO), **OPTIONS)
    train(_state(), _batch(0))
    wider = {"params": NET.init(jax.random.key(0), _batch(features=6)["x"])}
    wider = {**wider, "opt_state": TX.init(wider["params"]), "step": 0}
    given = hetpar.parallelize(step, plan=train.plan, cluster=hetpar.Cluster.virtual(TWO))
    with pytest.raises(hetpar.PlanError, match=r"argument \[0\]\['opt_state'\].* is float32\[6,16\] here but "
                                               r"float32\[8,16\] in the plan"):
        given(wider, _batch(features=6))

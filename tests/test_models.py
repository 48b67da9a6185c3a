"""The reference models train, and their steps are plain JAX."""

import jax
import numpy as np
import pytest

import models
from models import gpt, mlp


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_step_reduces_the_loss(name):
    w = models.get(name)
    step = jax.jit(w.step)
    state, losses = w.state, []
    for _ in range(5):
        state, loss = step(state, w.batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_gpt_initial_loss_is_near_uniform():
    config = gpt.GPTConfig()
    w = gpt.setup(config=config)
    assert float(w.loss_fn(w.state.params, w.batch)) == pytest.approx(np.log(config.vocab_size), rel=0.15)


def test_gpt_has_one_scope_per_block():
    w = gpt.setup(config=gpt.GPTConfig(n_layers=3))
    assert {k for k in w.state.params["params"] if k.startswith("Block_")} == {"Block_0", "Block_1", "Block_2"}


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_state_holds_params_and_optimizer_state(name):
    state = models.get(name).state
    assert state.params["params"] and jax.tree.leaves(state.opt_state)
    assert int(state.step) == 0


def test_gpt_batch_is_shifted_tokens():
    config = gpt.GPTConfig(vocab_size=10, seq_len=6)
    w = gpt.setup(batch_size=3, config=config)
    tokens, targets = np.asarray(w.batch["tokens"]), np.asarray(w.batch["targets"])
    assert tokens.shape == targets.shape == (3, 6) and tokens.dtype == targets.dtype == np.int32
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
    assert tokens.min() >= 0 and max(tokens.max(), targets.max()) < config.vocab_size


def test_batch_shapes():
    w = mlp.setup(batch_size=12, in_dim=5, out_dim=3)
    assert w.batch["x"].shape == (12, 5) and w.batch["y"].shape == (12, 3)
    with pytest.raises(KeyError, match="known: gpt, mlp"):
        models.get("resnet")

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


def test_batch_shapes():
    w = mlp.setup(batch_size=12, in_dim=5, out_dim=3)
    assert w.batch["x"].shape == (12, 5) and w.batch["y"].shape == (12, 3)
    with pytest.raises(KeyError, match="known: gpt, mlp"):
        models.get("resnet")

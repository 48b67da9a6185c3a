"""A plain MLP regressor: the smallest model with layers to pipeline."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from models.workload import Workload


class MLPBlock(nn.Module):
    """Dense + relu in its own scope, so name stacks group ops by block."""

    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.relu(nn.Dense(self.hidden)(x))


class MLP(nn.Module):
    hidden: int
    depth: int
    out_dim: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.depth):
            x = MLPBlock(self.hidden, name=f"Block_{i}")(x)
        return nn.Dense(self.out_dim, name="head")(x)


def setup(
    batch_size: int = 16,
    in_dim: int = 16,
    hidden: int = 32,
    depth: int = 4,
    out_dim: int = 8,
    seed: int = 0,
    optimizer: optax.GradientTransformation | None = None,
) -> Workload:
    """A random regression problem and an unmodified flax/optax step that fits it."""
    model = MLP(hidden, depth, out_dim)
    k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    batch = {
        "x": jax.random.normal(k_x, (batch_size, in_dim), jnp.float32),
        "y": jax.random.normal(k_y, (batch_size, out_dim), jnp.float32),
    }
    params = model.init(k_init, batch["x"])
    # eps=1e-3: Adam's default 1e-8 turns rounding noise in near-zero gradients into
    # full-size updates, which would make parity tests compare noise.
    tx = optimizer or optax.adamw(1e-2, eps=1e-3)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss_fn(params, batch):
        return jnp.mean((model.apply(params, batch["x"]) - batch["y"]) ** 2)

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    return Workload(train_step, state, batch, loss_fn, model)

"""A GPT-style decoder (nanoGPT's shape): embeddings, pre-norm blocks of causal
self-attention and MLP, final norm, LM head."""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from models.workload import Workload


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 4
    dtype: jnp.dtype = jnp.float32


class CausalSelfAttention(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        B, T, D = x.shape
        head_dim = D // c.n_heads
        qkv = nn.Dense(3 * D, dtype=c.dtype, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(B, T, 3, c.n_heads, head_dim), 3, axis=2)
        q, k, v = (t.squeeze(2) for t in (q, k, v))  # [B, T, H, hd]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(c.dtype)
        mask = jnp.tril(jnp.ones((T, T), bool))
        scores = jnp.where(mask, scores, jnp.finfo(c.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return nn.Dense(D, dtype=c.dtype, name="proj")(out.reshape(B, T, D))


class MLPBlock(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        h = nn.gelu(nn.Dense(c.mlp_ratio * c.d_model, dtype=c.dtype, name="up")(x))
        return nn.Dense(c.d_model, dtype=c.dtype, name="down")(h)


class Block(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        x = x + CausalSelfAttention(c, name="attn")(nn.LayerNorm(dtype=c.dtype, name="ln_1")(x))
        return x + MLPBlock(c, name="mlp")(nn.LayerNorm(dtype=c.dtype, name="ln_2")(x))


class GPT(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        positions = jnp.arange(tokens.shape[1])
        x = nn.Embed(c.vocab_size, c.d_model, dtype=c.dtype, name="wte")(tokens)
        x = x + nn.Embed(c.seq_len, c.d_model, dtype=c.dtype, name="wpe")(positions)
        for i in range(c.n_layers):
            x = Block(c, name=f"Block_{i}")(x)
        return nn.Dense(c.vocab_size, dtype=c.dtype, name="head")(nn.LayerNorm(dtype=c.dtype, name="ln_f")(x))


def setup(
    batch_size: int = 8,
    config: GPTConfig = GPTConfig(),
    seed: int = 0,
    optimizer: optax.GradientTransformation | None = None,
) -> Workload:
    """Random token sequences and an unmodified next-token-prediction step."""
    model = GPT(config)
    k_init, k_data = jax.random.split(jax.random.key(seed))
    sequence = jax.random.randint(k_data, (batch_size, config.seq_len + 1), 0, config.vocab_size, jnp.int32)
    batch = {"tokens": sequence[:, :-1], "targets": sequence[:, 1:]}
    params = model.init(k_init, batch["tokens"])
    tx = optimizer or optax.adamw(1e-2, eps=1e-3)  # eps: see models/mlp.py
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss_fn(params, batch):
        logits = model.apply(params, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    return Workload(train_step, state, batch, loss_fn, model)

"""A Llama-style decoder: RMSNorm, rotary attention, SwiGLU MLP, no biases, untied
head. Parameters are kept in `param_dtype` (f32 by default) and cast to `dtype` for
compute, the usual mixed-precision setup: the shape of the model the planner must
see through (its parameters reach the layers only through casts).

`LLAMA2_7B` and `LLAMA2_13B` are the published configurations, for planning
abstractly (`jax.eval_shape`); `TINYLLAMA_1B` is one that runs on a single accelerator
(benchmarks/one_device_step.py); tests use tiny ones."""

from __future__ import annotations

from dataclasses import dataclass, replace

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from models.workload import Workload


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 64
    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32

    def param_count(self) -> int:
        """Parameters by hand, from the shapes: embeddings, per block 4 d^2 attention +
        3 d d_ff MLP + 2 norms, final norm, head."""
        d = self.d_model
        block = 4 * d * d + 3 * d * self.d_ff + 2 * d
        return self.vocab_size * d + self.n_layers * block + d + d * self.vocab_size


LLAMA2_7B = LlamaConfig(vocab_size=32000, seq_len=4096, d_model=4096, n_heads=32, n_layers=32, d_ff=11008)
LLAMA2_13B = LlamaConfig(vocab_size=32000, seq_len=4096, d_model=5120, n_heads=40, n_layers=40, d_ff=13824)
# TinyLlama-1.1B's shapes (22 blocks of 2048, SwiGLU 5632, 32000 tokens) with full multi-head
# attention (its 4 key-value heads shared by 32 query heads would be 1.1B; this is 1.26B), at 1024
# tokens a sequence rather than its 2048: a 1B-class model one accelerator trains, AdamW included.
TINYLLAMA_1B = LlamaConfig(vocab_size=32000, seq_len=1024, d_model=2048, n_heads=32, n_layers=22, d_ff=5632)


class RMSNorm(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), c.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (normed * scale.astype(jnp.float32)).astype(c.dtype)


def _rotary(x: jax.Array) -> jax.Array:
    """Rotary position embedding over [B, T, H, hd]."""
    T, hd = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    angles = jnp.arange(T, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :].astype(x.dtype), jnp.sin(angles)[None, :, None, :].astype(x.dtype)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


class Attention(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        B, T, D = x.shape
        hd = D // c.n_heads
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype, name=name)  # noqa: E731
        q, k, v = (dense(D, n)(x).reshape(B, T, c.n_heads, hd) for n in ("q", "k", "v"))
        q, k = _rotary(q), _rotary(k)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(c.dtype)
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, jnp.finfo(c.dtype).min)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(c.dtype)
        return dense(D, "o")(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, D))


class MLP(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype, name=name)  # noqa: E731
        return dense(c.d_model, "down")(nn.silu(dense(c.d_ff, "gate")(x)) * dense(c.d_ff, "up")(x))


class Block(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + Attention(self.config, name="attn")(RMSNorm(self.config, name="ln_1")(x))
        return x + MLP(self.config, name="mlp")(RMSNorm(self.config, name="ln_2")(x))


class Llama(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        x = nn.Embed(c.vocab_size, c.d_model, dtype=c.dtype, param_dtype=c.param_dtype, name="embed")(tokens)
        for i in range(c.n_layers):
            x = Block(c, name=f"Block_{i}")(x)
        x = RMSNorm(c, name="ln_f")(x)
        logits = nn.Dense(c.vocab_size, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype, name="head")(x)
        return logits.astype(jnp.float32)


def setup(
    batch_size: int = 8,
    config: LlamaConfig = LlamaConfig(),
    seed: int = 0,
    optimizer: optax.GradientTransformation | None = None,
    abstract: bool = False,
) -> Workload:
    """Random token sequences and an unmodified next-token step with AdamW. With
    `abstract`, the state and batch are `jax.ShapeDtypeStruct` trees (nothing is
    allocated: a 7B model plans on a laptop)."""
    model = Llama(config)
    tx = optimizer or optax.adamw(1e-3, eps=1e-3)

    def make(key):
        k_init, k_data = jax.random.split(key)
        sequence = jax.random.randint(k_data, (batch_size, config.seq_len + 1), 0, config.vocab_size, jnp.int32)
        batch = {"tokens": sequence[:, :-1], "targets": sequence[:, 1:]}
        params = model.init(k_init, batch["tokens"][:1])
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx), batch

    state, batch = (jax.eval_shape if abstract else lambda f, k: f(k))(make, jax.random.key(seed))

    def loss_fn(params, batch):
        logits = model.apply(params, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    return Workload(train_step, state, batch, loss_fn, model)


def llama2_7b(batch_size: int = 64) -> Workload:
    """Llama-2-7B at its published size, abstract (for `hetpar solve models.llama:llama2_7b`):
    f32 parameters, bf16 compute, AdamW, `batch_size` sequences of 4096 tokens."""
    return setup(batch_size, LLAMA2_7B, abstract=True)


def llama2_7b_512(batch_size: int = 64) -> Workload:
    """Llama-2-7B's shapes at 512 tokens a sequence, abstract: a 7B model whose
    activations fit a 16 GB device's pipeline stage, so that its state decides where
    it fits (`examples/clusters/v100_offload_6.yaml`: only with host offload)."""
    return setup(batch_size, replace(LLAMA2_7B, seq_len=512), abstract=True)


def tinyllama_1b(batch_size: int = 8) -> Workload:
    """`TINYLLAMA_1B` with its arrays allocated (15 GB with AdamW's state): for
    `hetpar profile --layers models.llama:tinyllama_1b` and runs on one accelerator."""
    return setup(batch_size, TINYLLAMA_1B)

"""Fine-tune transformers' Flax GPT-2 (a tiny config) with hetpar, as an LM
fine-tuning script does: padding-masked mean loss, dropout on, an eval after every
step, an orbax checkpoint, and a resume under another plan.

6 CPU virtual devices stand in for 2 A100s, 2 V100s and 2 CPUs (three device
types, three stages); every loss is printed beside `jax.jit`'s on one device.
Needs the dev extra: pip install -e .[dev]  (transformers<5, orbax-checkpoint)
Run: .venv/bin/python examples/finetune_gpt2.py
"""

import logging
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import transformers  # noqa: E402

import hetpar  # noqa: E402

BATCH, LENGTH, VOCAB = 8, 8, 64
MODEL = transformers.FlaxGPT2LMHeadModel(
    transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=2, n_head=2), seed=0
)
TX = optax.adamw(1e-3, eps=1e-3)


def batch_of(i: int) -> dict:
    """Token ids with a padding mask of uneven lengths (every microbatch differs)."""
    ids = jax.random.randint(jax.random.key(i), (BATCH, LENGTH), 0, VOCAB)
    lengths = np.random.default_rng(i).integers(1, LENGTH + 1, BATCH)
    return {"input_ids": ids, "attention_mask": jnp.asarray((np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int32))}


def lm_loss(params, batch, dropout_key=None):
    train = dropout_key is not None
    logits = MODEL(batch["input_ids"], attention_mask=batch["attention_mask"], params=params,
                   dropout_rng=dropout_key, train=train).logits[:, :-1]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["input_ids"][:, 1:])
    mask = batch["attention_mask"][:, 1:].astype(jnp.float32)
    return jnp.sum(ce * mask) / jnp.sum(mask)


def train_step(state, batch):
    params, opt_state, key = state["params"], state["opt_state"], state["key"]
    key, dropout_key = jax.random.split(key)
    loss, grads = jax.value_and_grad(lm_loss)(params, batch, dropout_key)
    updates, opt_state = TX.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "key": key}, loss


def eval_step(params, batch):
    return lm_loss(params, batch)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    cluster = hetpar.Cluster.virtual({"A100": 2, "V100": 2, "cpu": 2})
    step = hetpar.parallelize(train_step, cluster=cluster, num_microbatches=4, num_stages=3)
    evaluate = hetpar.parallelize(eval_step, like=step)
    reference, ref_eval = jax.jit(train_step), jax.jit(eval_step)
    state = ref_state = {"params": MODEL.params, "opt_state": TX.init(MODEL.params), "key": jax.random.key(0)}
    held_out = batch_of(100)
    print(f"{'step':>4} {'hetpar loss':>12} {'jax.jit loss':>12} {'hetpar eval':>12} {'jax.jit eval':>12}")
    for i in range(3):
        state, loss = step(state, batch_of(i))
        ref_state, ref_loss = reference(ref_state, batch_of(i))
        print(f"{i:>4} {float(loss):>12.6f} {float(ref_loss):>12.6f} "
              f"{float(evaluate(state['params'], held_out)):>12.6f} {float(ref_eval(ref_state['params'], held_out)):>12.6f}")
    print("plan:", " | ".join(f"stage {s.index}: {s.device_type}" for s in step.plan.stages))

    with tempfile.TemporaryDirectory() as tmp:
        # Typed PRNG keys are stored as their key data; everything else as it is.
        saved = {**state, "key": jax.random.key_data(state["key"])}
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(Path(tmp) / "step3", saved)
        checkpointer.wait_until_finished()
        one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), saved)
        restored = checkpointer.restore(Path(tmp) / "step3", target)
        restored["key"] = jax.random.wrap_key_data(restored["key"])

    # Resume under another plan: two device types, two stages, two microbatches.
    resumed = hetpar.parallelize(train_step, cluster=hetpar.Cluster.virtual({"A100": 2, "V100": 2}),
                                 num_microbatches=2, num_stages=2)
    state = restored
    for i in range(3, 5):
        state, loss = resumed(state, batch_of(i))
        ref_state, ref_loss = reference(ref_state, batch_of(i))
        print(f"{i:>4} {float(loss):>12.6f} {float(ref_loss):>12.6f}   (resumed from the checkpoint on a 2-stage plan)")


if __name__ == "__main__":
    main()

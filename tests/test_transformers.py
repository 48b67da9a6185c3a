"""transformers' Flax GPT-2, BERT and Llama (tiny configs) trained through hetpar:
padding-masked LM losses, dropout on, parity with `jax.jit(step)` (issue 14).

Flax Llama's rotary table needs `max_position_embeddings` above the sequence length
here: with both 8, transformers 4.57 fails under plain `jax.jit` too (`mul got
incompatible shapes (1, 1, 2, 8), (1, 1, 1, 4)`)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetpar
from parity import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from real_models import lm_step  # noqa: E402

transformers = pytest.importorskip("transformers")  # a dev extra: `pip install -e .[dev]`

THREE = {"A100": 2, "V100": 2, "cpu": 2}
TWO = {"A100": 2, "V100": 2}
B, T, VOCAB = 8, 8, 64


def _batch():
    ids = jax.random.randint(jax.random.key(1), (B, T), 0, VOCAB)
    lengths = np.array([8, 2, 5, 8, 1, 6, 3, 7])  # uneven padding across microbatches
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    return {"input_ids": ids, "attention_mask": jnp.asarray(mask)}


def _lm_step(model, tx, causal=True):
    def step(state, batch):
        params, opt_state, key = state
        key, dropout_key = jax.random.split(key)

        def loss_fn(p):
            logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], params=p,
                           dropout_rng=dropout_key, train=True).logits
            if causal:
                logits, labels, mask = logits[:, :-1], batch["input_ids"][:, 1:], batch["attention_mask"][:, 1:]
            else:
                labels, mask = batch["input_ids"], batch["attention_mask"]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            mask = mask.astype(jnp.float32)
            return jnp.sum(ce * mask) / jnp.sum(mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    return step


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=2, n_head=2)
    return transformers.FlaxGPT2LMHeadModel(cfg, seed=0), True


def _bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=T)
    return transformers.FlaxBertForMaskedLM(cfg, seed=0), False


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4 * T,
                                   attention_dropout=0.1)
    return transformers.FlaxLlamaForCausalLM(cfg, seed=0), True


@pytest.mark.parametrize("make,cluster,microbatches", [
    (_gpt2, THREE, 4), (_bert, TWO, 2), (_llama, THREE, 2),
], ids=["gpt2-3types-4mb", "bert-2types-2mb", "llama-3types-2mb"])
def test_transformers_lm_with_dropout_and_padding_matches_jit(make, cluster, microbatches):
    model, causal = make()
    tx = optax.adamw(1e-3, eps=1e-3)  # a tiny eps turns summation-order noise into large updates
    step = _lm_step(model, tx, causal)
    state = (model.params, tx.init(model.params), jax.random.key(5))
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(cluster), num_microbatches=microbatches,
                                  num_stages=len(cluster))
    ref_state = par_state = state
    for i in range(2):
        ref_state, ref_loss = jax.jit(step)(ref_state, _batch())
        par_state, par_loss = parallel(par_state, _batch())
        assert_close(par_loss, ref_loss, f"loss, step {i}")
        assert_close(par_state, ref_state, f"state after step {i}")
    assert parallel.plan.num_stages == len(cluster)


def test_flax_llama_7b_width_plans_that_the_placement_accepts(tmp_path):
    """transformers' FlaxLlama at Llama-2-7B's width (bf16 compute, f32 parameters,
    AdamW), four blocks deep, traced abstractly and planned on four V100-32GB where
    memory decides the plan: whatever the planner returns passes the placement's fit
    check, since both ask the one memory model (before, the planner returned plans
    that the placement then refused)."""
    from hetpar.cluster.cluster import Cluster
    from hetpar.pipeline import solve
    from hetpar.plan.costs import estimate_plan
    from hetpar.trace.traced_step import trace_step
    from solver.cost.estimate import Decisions, StageDecision, estimate

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                                   num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048)
    model = transformers.FlaxLlamaForCausalLM(cfg, _do_init=False, dtype=jnp.bfloat16)
    batch, seq = 16, 2048
    step, (state, inputs) = lm_step(model, batch, seq)  # benchmarks/real_models.py: the step as a user writes it
    (tmp_path / "v100.yaml").write_text("groups:\n  - name: v100\n    device: V100\n    nodes: 1\n    devices_per_node: 4\n")
    cluster = Cluster.from_file(str(tmp_path / "v100.yaml")).numbered()
    plan = solve(trace_step(step, (state, inputs), 1, 1), cluster, search_microbatches=True)  # raises if placement refuses
    cost = estimate_plan(plan)
    assert cost.fits and all(0 < s.memory_bytes <= s.memory_capacity for s in plan.stages)
    # Memory decides here: plain data parallelism over the four (state replicated, the
    # batch in one go) does not fit.
    whole = Decisions((StageDecision("v100", 4, 1, 0, len(plan.cost_inputs.layers)),), 1, "1f1b", (batch,))
    assert not estimate(plan.cost_inputs, whole).fits

"""Real models at real sizes, planned abstractly: Llama-2-7B and -13B (models/llama.py),
and transformers' FlaxLlama (Llama-2-7B, Llama-2-70B) and FlaxGPT2 (GPT-2 XL) as a
user writes them (f32 parameters, bf16 compute, AdamW), their state and batch
`jax.eval_shape` trees, traced and planned on the cluster files of
examples/clusters/ as `hetpar solve` would, with the planner choosing stages,
layers, data and tensor parallelism, replicas, the schedule and the microbatch count.

Prints per model and cluster the time to trace, to plan (search, mesh shapes and
parameter shardings), the layers it planned over (how many are whole repeated
blocks, found by structure at whatever module depth they sit), and the plan's figures, ending with
RESULT model=<m> cluster=<c> solve_s=<s> layers=<n> blocks=<b> mfu=<x> bound_ratio=<y, or none where no kind alone fits>
(solve_s: trace + plan + shardings, end to end). Goal: 7B <= 60 s on a 2-core machine.
The transformers setups are also `hetpar solve` targets, e.g.
    hetpar solve benchmarks/real_models.py:hf_llama2_7b --cluster examples/clusters/two_types.yaml -o plan.json
Run: .venv/bin/python benchmarks/real_models.py [--model llama2-7b] [--cluster two_types]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from hetpar.cluster.cluster import Cluster
from hetpar.errors import HetparError
from hetpar.pipeline import solve
from hetpar.trace.flops import op_costs
from hetpar.trace.layers import structure_of
from hetpar.trace.traced_step import trace_step
from models import llama

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"


def _llama(config: llama.LlamaConfig):  # noqa: ANN202
    def make(batch: int) -> tuple:
        w = llama.setup(batch, config, abstract=True)
        return w.step, (w.state, w.batch)
    return make


def lm_step(model, batch: int, seq: int) -> tuple:  # noqa: ANN001
    """A language-model step on transformers' Flax `model` as a user writes it (AdamW,
    bf16 logits cast to f32 for the loss): `(step, (state, batch))`, abstract."""
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.adamw(1e-4)

    def build():
        params = model.init_weights(jax.random.key(0), (1, seq))
        return (params, tx.init(params)), {"input_ids": jnp.zeros((batch, seq), jnp.int32)}

    def step(state, inputs):
        params, opt_state = state

        def loss_fn(p):
            logits = model(inputs["input_ids"], params=p).logits[:, :-1].astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, inputs["input_ids"][:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, jax.eval_shape(build)


def _transformers(name: str, seq: int):  # noqa: ANN202
    """transformers' Flax model `name` at its published size, abstract, with `lm_step`."""
    def make(batch: int) -> tuple:
        import jax.numpy as jnp
        import transformers

        config = HF_CONFIGS[name]()
        cls = transformers.FlaxLlamaForCausalLM if name.startswith("llama") else transformers.FlaxGPT2LMHeadModel
        return lm_step(cls(config, _do_init=False, dtype=jnp.bfloat16), batch, seq)
    return make


def _hf_llama(hidden: int, ff: int, layers: int, heads: int, kv_heads: int):  # noqa: ANN202
    def config():  # noqa: ANN202
        import transformers
        return transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers,
                                        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096)
    return config


def _hf_gpt2_xl():  # noqa: ANN202
    import transformers
    return transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25)


HF_CONFIGS = {"llama2-7b": _hf_llama(4096, 11008, 32, 32, 32), "llama2-70b": _hf_llama(8192, 28672, 80, 64, 8),
              "gpt2-xl": _hf_gpt2_xl}
MODELS = {"llama2-7b": _llama(llama.LLAMA2_7B), "llama2-13b": _llama(llama.LLAMA2_13B),
          "hf-llama2-7b": _transformers("llama2-7b", 4096), "hf-llama2-70b": _transformers("llama2-70b", 4096),
          "hf-gpt2-xl": _transformers("gpt2-xl", 1024)}
DEFAULT_MODELS = ("llama2-7b", "llama2-13b", "hf-llama2-7b", "hf-llama2-70b", "hf-gpt2-xl")


def hf_llama2_7b(batch_size: int = 64) -> tuple:
    """`hetpar solve benchmarks/real_models.py:hf_llama2_7b`: transformers' FlaxLlama at Llama-2-7B's size."""
    return MODELS["hf-llama2-7b"](batch_size)


def hf_llama2_70b(batch_size: int = 64) -> tuple:
    """transformers' FlaxLlama at Llama-2-70B's size (grouped-query attention, 80 blocks)."""
    return MODELS["hf-llama2-70b"](batch_size)


def hf_gpt2_xl(batch_size: int = 64) -> tuple:
    """transformers' FlaxGPT2 at GPT-2 XL's size (48 blocks)."""
    return MODELS["hf-gpt2-xl"](batch_size)
SCENARIOS = {  # cluster file -> global batch (sequences of 4096 tokens)
    "two_types": ("two_types.yaml", 64),
    "v100_32": ("v100_32.yaml", 64),
    "three_types_768": ("three_types_768.yaml", 1536),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), action="append")
    parser.add_argument("--cluster", choices=sorted(SCENARIOS), action="append")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = []
    for model in args.model or list(DEFAULT_MODELS):
        for name in args.cluster or list(SCENARIOS):
            file, batch = SCENARIOS[name]
            cluster = Cluster.from_file(str(CLUSTERS / file)).numbered()
            started = time.perf_counter()
            step, step_args = MODELS[model](batch)
            traced = trace_step(step, step_args, 1, 1)
            traced_s = time.perf_counter() - started
            found = structure_of(traced.full, traced.analysis, [c.flops for c in op_costs(traced.full)])
            pieces = f"{found.blocks} blocks + {found.pieces - found.blocks} other pieces" if found else "no repeated blocks"
            structure = f"blocks={found.blocks if found else 0} pieces={found.pieces if found else 1}"
            print(f"{model}: traced in {traced_s:.1f} s; structure: {pieces}"
                  + (f" ({found.labels[0]} | {found.labels[1]} .. {found.labels[-2]} | {found.labels[-1]})" if found else ""))
            try:
                plan = solve(traced, cluster, search_microbatches=True)
            except HetparError as e:  # reported, not hidden: the planner and the final check disagree
                print(f"{model} on {cluster.describe()}: {e}")
                results.append(f"RESULT model={model} cluster={name} solve_s={time.perf_counter() - started:.1f} "
                               f"{structure} error=plan_refused")
                continue
            total_s = time.perf_counter() - started
            print(f"{model} on {cluster.describe()}, batch {batch}: traced in {traced_s:.1f} s, planned in "
                  f"{total_s - traced_s:.1f} s over {plan.num_layers} layers; {plan.num_microbatches} microbatches, "
                  f"{plan.schedule}, {len(plan.stages)} stages, {plan.num_replicas} replica(s)")
            for s in plan.stages:
                print(f"  stage {s.index} r{s.replica} {s.device_type} x{s.num_devices} dp{s.data_parallel}xtp{s.tensor_parallel} "
                      f"layers {s.layer_start}-{s.layer_end - 1} zero{s.zero}{' remat' if s.remat else ''} sync {s.sync_s * 1e3:.0f} ms optimizer {s.optimizer_s * 1e3:.0f} ms "
                      f"memory {s.memory_bytes / 2**30:.1f}/{s.memory_capacity / 2**30:.0f} GiB")
            print(f"  predicted step {plan.predicted_step_time_s:.2f} s, {plan.tokens_per_s:,.0f} tokens/s, MFU {plan.mfu:.1%}")
            results.append(f"RESULT model={model} cluster={name} solve_s={total_s:.1f} layers={plan.num_layers} {structure} "
                           f"mfu={plan.mfu:.3f} bound_ratio={'none' if plan.bound_ratio is None else f'{plan.bound_ratio:.3f}'}")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()

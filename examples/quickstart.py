"""hetpar in one screen: a GPT train step, unmodified, pipelined over two device types.

1. Runs: 8 CPU virtual devices stand in for 4 H100s and 4 V100s. The step is split
   into two stages, one per kind, and the faster kind takes more layers; the losses
   match `jax.jit` on one device.
2. Plans: a 1.3B-parameter GPT in fp16 (abstract: only its shapes are traced; fp16,
   as Megatron trains on V100s, which have no bf16 matmul units and run bf16 at their
   fp32 rate) on a cluster of 8 A100s and 16 V100s, where hetpar's plan (both kinds,
   the A100s taking more layers) is compared with the best plan on the A100s alone
   and with Megatron's uniform split, all priced by the same cost model.
Run: scripts/demo.sh   (or .venv/bin/python examples/quickstart.py)
"""

from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import hetpar  # noqa: E402
from hetpar.plan.auto import SearchOptions, problem_for  # noqa: E402
from hetpar.plan import fmt_time  # noqa: E402
from hetpar.pipeline import layers_of  # noqa: E402
from hetpar.trace.traced_step import trace_step  # noqa: E402
from models import gpt  # noqa: E402
from solver.baselines import fastest_only, uniform  # noqa: E402
from solver.planner import plan as search  # noqa: E402


def run_small() -> None:
    workload = gpt.setup(batch_size=8, config=gpt.GPTConfig(n_layers=6))
    cluster = hetpar.Cluster.virtual({"H100": 4, "V100": 4})

    @hetpar.parallelize(cluster=cluster, num_microbatches=4, num_stages=2, num_layers=8, schedule="1f1b")
    def train_step(state, batch):
        return workload.step(state, batch)

    reference = jax.jit(workload.step)
    state = ref_state = workload.state
    rows = []
    for i in range(5):
        state, loss = train_step(state, workload.batch)
        ref_state, ref_loss = reference(ref_state, workload.batch)
        rows.append((i, float(loss), float(ref_loss)))

    print(train_step.plan)
    print()
    print(f"{'step':>4}  {'hetpar loss':>12}  {'jax.jit loss':>12}  {'|diff|':>9}")
    for i, loss, ref in rows:
        print(f"{i:>4}  {loss:>12.6f}  {ref:>12.6f}  {abs(loss - ref):>9.2e}")


def plan_large() -> None:
    config = gpt.GPTConfig(n_layers=24, d_model=2048, n_heads=16, seq_len=1024, vocab_size=32000, dtype=jax.numpy.float16)
    built = {}

    def build():
        w = gpt.setup(batch_size=32, config=config)
        built["step"] = w.step
        return w.state, w.batch

    state, batch = jax.eval_shape(build)  # shapes only: nothing of 1.3B parameters is allocated
    traced = trace_step(built["step"], (state, batch), 1, 1)
    layers = layers_of(traced, 12)
    cluster = hetpar.Cluster.from_file(Path(__file__).parent / "clusters" / "quickstart_24.yaml").numbered()
    problem = problem_for(layers, cluster, traced.batch_size, config.seq_len, SearchOptions(dtype="float16"))
    rows = [("hetpar (both kinds, non-uniform split)", search(problem).best),
            ("A100s only", fastest_only(problem)),
            ("uniform split (Megatron)", uniform(problem))]
    print(f"\nplanning a {sum(layers.param_bytes) / 4 / 1e9:.1f}B-parameter GPT in fp16 (batch 32 x 1024 tokens) "
          f"on {cluster.describe()}:")
    print(f"  {'plan':<40} {'step time':>10} {'tokens/s':>10}  stages (kind: devices, layers)")
    for name, choice in rows:
        if choice is None:
            print(f"  {name:<40} {'no plan fits':>10}")
            continue
        stages = ", ".join(f"{s.kind}: {s.devices}, {s.layer_end - s.layer_start}" for s in choice.stages)
        print(f"  {name:<40} {fmt_time(choice.step_s):>10} {choice.tokens_per_s:>10,.0f}  {stages}")


if __name__ == "__main__":
    run_small()
    plan_large()

"""Real models at real sizes, planned abstractly: Llama-2-7B and -13B (f32 parameters,
bf16 compute, AdamW), their state and batch `jax.eval_shape` trees, traced and
planned on the cluster files of examples/clusters/ as `hetpar solve` would, with
the planner choosing stages, layers, data and tensor parallelism, replicas, the
schedule and the microbatch count.

Prints per model and cluster the time to trace, to plan (search, mesh shapes and
parameter shardings), the layers it planned over, and the plan's figures, ending with
RESULT model=<m> cluster=<c> solve_s=<s> layers=<n> mfu=<x> bound_ratio=<y>
(solve_s: trace + plan + shardings, end to end). Goal: 7B <= 60 s on a 2-core machine.
Run: .venv/bin/python benchmarks/real_models.py [--model 7b] [--cluster two_types]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from hetpar.cluster.cluster import Cluster
from hetpar.errors import HetparError
from hetpar.pipeline import solve
from hetpar.trace.traced_step import trace_step
from models import llama

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
MODELS = {"llama2-7b": llama.LLAMA2_7B, "llama2-13b": llama.LLAMA2_13B}
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
    for model in args.model or list(MODELS):
        for name in args.cluster or list(SCENARIOS):
            file, batch = SCENARIOS[name]
            cluster = Cluster.from_file(str(CLUSTERS / file)).numbered()
            started = time.perf_counter()
            w = llama.setup(batch, MODELS[model], abstract=True)
            traced = trace_step(w.step, (w.state, w.batch), 1, 1)
            traced_s = time.perf_counter() - started
            try:
                plan = solve(traced, cluster, search_microbatches=True)
            except HetparError as e:  # reported, not hidden: the planner and the final check disagree
                print(f"{model} on {cluster.describe()}: {e}")
                results.append(f"RESULT model={model} cluster={name} solve_s={time.perf_counter() - started:.1f} error=plan_refused")
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
            results.append(f"RESULT model={model} cluster={name} solve_s={total_s:.1f} layers={plan.num_layers} "
                           f"mfu={plan.mfu:.3f} bound_ratio={plan.bound_ratio:.3f}")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()

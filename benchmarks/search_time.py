"""How fast is the planner at the scale of real heterogeneous clusters, and how good
are its plans against the published alternatives under the same cost model?

Three scenarios, each a model on paper (solver.transformer) and a cluster file from
examples/clusters/, bf16 with mixed-precision Adam (16 bytes of state per parameter):
  hethub           an 80-layer Llama-style 140B model, 128 MI250X + 640 A100
  two_types_512    GPT-3 175B, 256 A100 + 256 V100
  three_types_768  GPT-3 175B, 256 H100 + 256 A100 + 256 V100
For each: hetpar's search time, its predicted throughput and its ratio to the upper
bound (the sum over kinds of the best plan on that kind alone), and the baselines of
solver/baselines.py. The search is exact: it runs until it proves its plan the best
under the model (or stops at --time-limit and prints the gap).
Ends with one line per scenario:
RESULT scenario=<name> search_s=<s> bound_ratio=<fraction> vs_uniform=<hetpar/uniform>
       best_baseline_ratio=<hetpar/best baseline> baseline_search_s=<Metis-like search seconds>
Run: .venv/bin/python benchmarks/search_time.py [--scenario NAME] [--time-limit S]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hetpar.cluster.cluster import Cluster
from hetpar.plan.auto import device_kinds, group_links
from solver.baselines import run_all
from solver.planner import Problem, plan
from solver.transformer import GPT3_175B, LLAMA_140B, Transformer

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
SCENARIOS: dict[str, tuple[Transformer, str, int]] = {
    # model, cluster file, global batch (sequences)
    "hethub": (LLAMA_140B, "hethub_768.yaml", 1024),
    "two_types_512": (GPT3_175B, "two_types_512.yaml", 1536),
    "three_types_768": (GPT3_175B, "three_types_768.yaml", 1536),
}
MICROBATCHES = (16, 32, 64, 128, 256, 512)


def problem_for(name: str) -> Problem:
    model, cluster_file, batch = SCENARIOS[name]
    return problem_on(model, Cluster.from_file(str(CLUSTERS / cluster_file)), batch, microbatches=MICROBATCHES)


def problem_on(model: Transformer, cluster: Cluster, batch: int, dtype: str = "bfloat16",
               microbatches: tuple[int, ...] | None = None) -> Problem:
    """A model on paper on a cluster, trained in `dtype` (16-bit) with mixed-precision
    Adam; `microbatches` None: any count dividing the batch, as `hetpar solve` searches."""
    return Problem(
        model.layer_costs(), device_kinds(cluster, dtype), batch, group_links(cluster), tokens_per_example=model.seq,
        state_factor=8.0,  # 16-bit parameters: + 16-bit gradients + fp32 master copy and two moments = 16 bytes / 2
        optimizer_traffic=14.0, memory_reserve=0.1, microbatches=microbatches, max_tp=8, allow_remat=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--time-limit", type=float, default=None, help="stop the search here and report its gap")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=170)
    results = []
    for name in args.scenario or list(SCENARIOS):
        problem = problem_for(name)
        started = time.perf_counter()
        found = plan(problem, top_k=1, time_limit_s=args.time_limit)
        search_s = time.perf_counter() - started
        baselines = run_all(problem)
        table = Table(title=f"{name}: {SCENARIOS[name][0].num_params() / 1e9:.0f}B parameters on "
                            f"{' + '.join(f'{k.count} {k.name}' for k in problem.kinds)}")
        for column in ("planner", "search s", "step s", "tokens/s", "MFU", "vs hetpar", "plan"):
            table.add_column(column)
        best = found.best
        table.add_row("hetpar", f"{search_s:.2f}", f"{best.step_s:.2f}", f"{best.tokens_per_s:,.0f}", f"{best.mfu:.1%}",
                      "1.00", best.describe()[:60])
        for b in baselines:
            if b.plan is None:
                table.add_row(b.name, f"{b.search_s:.2f}", "no plan fits", "", "", "", "")
                continue
            table.add_row(b.name, f"{b.search_s:.2f}", f"{b.plan.step_s:.2f}", f"{b.plan.tokens_per_s:,.0f}",
                          f"{b.plan.mfu:.1%}", f"{b.plan.throughput / best.throughput:.2f}", b.plan.describe()[:60])
        console.print(table)
        console.print(f"upper bound (each kind alone, summed): {found.upper_bound * problem.tokens_per_example:,.0f} tokens/s; "
                      + (f"hetpar reaches {found.bound_ratio:.1%}" if found.bound_ratio is not None else "no kind alone fits the model") + (f"; search stopped with a gap of {found.gap:.1%}" if found.gap else ""))
        throughput = {b.name: b.plan.throughput for b in baselines if b.plan is not None}
        metis_s = next(b.search_s for b in baselines if b.name == "metis_like")
        ratio = "none" if found.bound_ratio is None else f"{found.bound_ratio:.3f}"
        results.append(
            f"RESULT scenario={name} search_s={search_s:.2f} bound_ratio={ratio} "
            f"vs_uniform={best.throughput / throughput['uniform']:.3f} "
            f"best_baseline_ratio={best.throughput / max(throughput.values()):.3f} baseline_search_s={metis_s:.2f}"
            if "uniform" in throughput else f"RESULT scenario={name} search_s={search_s:.2f} bound_ratio={ratio}"
        )
    for line in results:
        print(line)


if __name__ == "__main__":
    main()

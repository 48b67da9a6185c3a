"""What in-network reduction (SHARP) is worth on 1,024 A100s, under hetpar's one cost
model: the same cluster file with and without the fabric's switch reduction
(examples/clusters/a100_1024.yaml, a100_1024_sharp.yaml).

1. The data-parallel all-reduce of one stage over all 1,024 GPUs (the topology the
   planner prices a stage's gradient sync on: 128 nodes of 8, NVLink inside, one
   HDR NIC per GPU), per registered algorithm, at several message sizes.
2. The planner's best plan for GPT-3 175B on paper (solver.transformer, bf16, mixed
   precision Adam) with and without, at several global batch sizes (a smaller batch
   on the same cluster leaves less compute to hide each step's gradient sync
   behind), and the algorithm the estimator chose for each plan's collectives.

Ends with
RESULT sharp_allreduce_ratio=<r> sharp_changes_plan=<0|1>
(r: the in-network all-reduce's time over the fastest other algorithm's for a 1 GiB
message on the 1,024 GPUs; sharp_changes_plan: 1 where the planner's best plan
differs between the two cluster files at some batch of the sweep, which the line
before it details). Also printed: the across-node step alone (the switches' M/8
against the host-driven all-reduce's), where the "about half" of in-network
reduction lives; the node-local NVLink reduce-scatter and all-gather, which both
algorithms run one after the other with it, the switches do not make faster.
Run: .venv/bin/python benchmarks/collectives.py [--model gpt3-175b|gpt-13b] [--time-limit S]
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hetpar.cluster.cluster import Cluster
from hetpar.plan.auto import device_kinds, group_links
from solver import collectives
from solver.collectives import Topology
from solver.collectives.in_network import switch_all_reduce
from solver.cost.collectives_used import collectives_used
from solver.cost.stage_costs import StageConfig
from solver.cost.topologies import dp_topology
from solver.planner import PlanChoice, Problem, plan
from solver.planner.step import decisions
from solver.transformer import GPT3_175B, Transformer

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
FILES = {"without": "a100_1024.yaml", "with": "a100_1024_sharp.yaml"}
MODELS = {
    "gpt3-175b": GPT3_175B,
    "gpt-13b": Transformer(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200),
}
BATCHES = (256, 512, 1024, 1536)  # global batch, sequences (GPT-3 175B's own was 1536)
SIZES = (2**16, 2**20, 2**24, 2**30)
LARGE = 2**30
MICROBATCHES = (16, 32, 64, 128, 256, 512, 1024)


def problem_for(cluster: Cluster, model: Transformer, batch: int) -> Problem:
    return Problem(
        model.layer_costs(), device_kinds(cluster, "bfloat16"), batch, group_links(cluster), tokens_per_example=model.seq,
        state_factor=8.0,  # bf16 parameters: + bf16 gradients + fp32 master copy and two moments = 16 bytes / 2
        optimizer_traffic=14.0, memory_reserve=0.1, microbatches=MICROBATCHES, max_tp=8, allow_remat=True,
    )


def data_parallel_topology(problem: Problem) -> Topology:
    """A 1,024-way data-parallel stage as the planner prices its gradient sync."""
    kind = problem.kinds[0]
    return dp_topology(kind, StageConfig(kind.name, kind.count, 1))


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:,.2f} ms"


def all_reduce_table(topologies: dict[str, Topology]) -> dict[str, dict[int, dict[str, float]]]:
    """Every algorithm's time at each size, with SHARP (without it: the same, less
    the in-network algorithm, which is checked)."""
    out = {label: {m: collectives.costs("all_reduce", topo, m) for m in SIZES} for label, topo in topologies.items()}
    for m in SIZES:
        assert out["without"][m] == {k: v for k, v in out["with"][m].items() if k != "in_network"}, m
    table = Table(title="all-reduce over 1,024 A100s (128 nodes x 8, with SHARP; without it the same less in_network), "
                        "fastest in bold")
    table.add_column("algorithm")
    for m in SIZES:
        table.add_column(f"{m / 2**20:g} MiB", justify="right")
    for name in (n for n in collectives.names() if n in out["with"][SIZES[0]]):
        best = [min(out["with"][m].values()) for m in SIZES]
        cells = [_us(out["with"][m][name]) for m in SIZES]
        table.add_row(name, *(f"[bold]{c}[/bold]" if out["with"][m][name] == b else c for c, m, b in zip(cells, SIZES, best)))
    Console(width=160).print(table)
    return out


def across_level(topo: Topology, nbytes: float) -> tuple[float, float]:
    """The across-node step alone, each GPU's 1/8 of the message over its NIC: the
    switches' all-reduce and the best host-driven one (hierarchical's level)."""
    d = topo.devices_per_node
    link = topo.inter.per_flow(d)
    hosts = Topology(1, topo.nodes, replace(link, reduction=None), replace(link, reduction=None))
    return switch_all_reduce(nbytes / d, link), collectives.best("all_reduce", hosts, nbytes / d)[1]


def best_plan(problem: Problem, time_limit_s: float | None) -> tuple[PlanChoice, float]:
    start = time.perf_counter()
    result = plan(problem, time_limit_s=time_limit_s)
    return result.best, time.perf_counter() - start


def same_plan(a: PlanChoice, b: PlanChoice) -> bool:
    shape = lambda c: (c.schedule, c.num_microbatches, c.chunks, c.replica_batch,  # noqa: E731
                       tuple((s.kind, s.dp, s.tp, s.layer_start, s.layer_end, s.remat, s.zero, s.replica) for s in c.stages))
    return shape(a) == shape(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt3-175b")
    parser.add_argument("--time-limit", type=float, default=None, help="stop each search here (default: until proven)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = MODELS[args.model]
    problems = {label: problem_for(Cluster.from_file(str(CLUSTERS / name)), model, BATCHES[0]) for label, name in FILES.items()}
    topologies = {label: data_parallel_topology(p) for label, p in problems.items()}

    costs = all_reduce_table(topologies)
    large = costs["with"][LARGE]
    others = {k: v for k, v in large.items() if k != "in_network"}
    other = min(others, key=others.get)
    ratio = large["in_network"] / others[other]
    switches, hosts = across_level(topologies["with"], LARGE)
    print(f"1 GiB all-reduce on 1,024 GPUs: in_network {_us(large['in_network'])}, best other {other} {_us(others[other])} "
          f"(ratio {ratio:.3f}); without SHARP the best is {min(costs['without'][LARGE], key=costs['without'][LARGE].get)} "
          f"{_us(min(costs['without'][LARGE].values()))}")
    print(f"  across nodes alone (each GPU's 128 MiB through its NIC): switches {_us(switches)}, host-driven {_us(hosts)} "
          f"(ratio {switches / hosts:.3f}); the NVLink reduce-scatter and all-gather inside each node are the same in both")

    changed = []
    for batch in BATCHES:
        chosen = {}
        for label, problem in problems.items():
            problem = replace(problem, batch_size=batch)
            choice, seconds = best_plan(problem, args.time_limit)
            chosen[label] = choice
            print(f"\n{args.model}, batch {batch}, {label} SHARP: {choice.describe()}")
            print(f"  step {choice.step_s:.3f} s, {choice.tokens_per_s:,.0f} tokens/s, MFU {choice.mfu:.1%} (search {seconds:.1f} s)")
            print("  collectives: " + "; ".join(_collectives(problem, choice)))
        if not same_plan(chosen["with"], chosen["without"]):
            changed.append(batch)
        print(f"  SHARP {'changes the plan' if batch in changed else 'keeps the plan'}; step "
              f"{chosen['without'].step_s / chosen['with'].step_s:.3f}x faster")
    print(f"\nthe planner's plan changes with SHARP at batch {', '.join(map(str, changed)) or 'none'} of "
          f"{', '.join(map(str, BATCHES))}")
    print(f"RESULT sharp_allreduce_ratio={ratio:.3f} sharp_changes_plan={int(bool(changed))}")


def _collectives(problem: Problem, choice: PlanChoice) -> list[str]:
    """Each kind of collective of the plan, its algorithm and its longest call."""
    kinds: dict[tuple, float] = {}
    for u in collectives_used(problem, decisions(choice)):
        key = (u.purpose, u.collective, u.devices, u.algorithm)
        kinds[key] = max(kinds.get(key, 0.0), u.seconds)
    return [f"{purpose} {collective} over {devices} -> {algorithm} (up to {_us(t)})"
            for (purpose, collective, devices, algorithm), t in kinds.items()]


if __name__ == "__main__":
    main()

"""How fast does the planner search at the scale of Metis's and HETHUB's clusters,
and how close to its own bound are the plans it returns?

Search times are wall seconds (the RESULT line's) and this process's CPU seconds
(on a shared, loaded machine wall time also counts other processes' turns), those of
the middle of `--repeats` solves of the scenario by wall time (default 3: the median;
one solve's time on a shared 2-core machine varies by half), with their range.

Scenarios (models on paper, `solver.transformer`; clusters built here as cluster
specs, nodes of 8 GPUs):
- Metis's (Um et al., ATC'24; its open planner's GPT settings: hidden 4096, 32
  heads, sequence 1024, vocabulary 51200, global batch 128 on 16 GPUs, scaled with
  the cluster), with 10 and 34 layers (Metis counts the embedding and the head as
  layers; here they ride on the first and last block), fp16 as Metis's Megatron
  runs it, on 16, 64 and 256 GPUs of two kinds (A100 + V100, half each) and three
  kinds (A100 + V100 + T4: half A100, a quarter each of V100 and T4; 16 GPUs: 8
  A100 and a 4-GPU node each of V100 and T4);
- HETHUB's scale with three kinds: an 80-layer Llama-style 140B model (one planning
  layer per block) on 256 H100 + 256 A100 + 256 V100 (examples/clusters/
  three_types_768.yaml), bf16.
The problem is built as `search_time.py` builds its own (16-bit mixed-precision
Adam, 10% of memory kept for XLA), with any microbatch count dividing the batch, as
`hetpar solve` searches by default. Per scenario: the search time, the chosen plan,
its step time as the estimator prices it, whether the search proved it the best of
its space, where the search's time went (`SearchResult.phases`: the search of
pipelines, of pipelines side by side, the estimator's ranking, mixed-kind stages,
and the bound's searches), and its gap to the planner's bound (each kind's best plan
alone, summed: a reference that a plan across kinds exceeds where a kind alone fits
the model badly).

Ends with
RESULT s64_3t_s=<t> s256_3t_s=<t> s768_3t_s=<t> mixed_stage_chosen=<n>
(search seconds of the 34-layer model on 64 and 256 GPUs of three kinds and of the
768-GPU scenario; mixed_stage_chosen: scenarios whose chosen plan has a stage whose
data-parallel parts are of different kinds, solver/planner/mixed.py: chosen only where
the estimator prices it faster).
Run: .venv/bin/python benchmarks/search_scale.py [--scenario NAME ...] [--finalists K] [--repeats N]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_time import CLUSTERS, problem_on  # noqa: E402

from hetpar.cluster.catalog import Link  # noqa: E402
from hetpar.cluster.cluster import Cluster  # noqa: E402
from hetpar.cluster.groups import DeviceGroup, GroupLink  # noqa: E402
from solver.planner import Planner, Problem  # noqa: E402
from solver.planner.search import FINALISTS  # noqa: E402
from solver.transformer import LLAMA_140B, Transformer  # noqa: E402

METIS_GPT = dict(hidden=4096, heads=32, seq=1024, vocab=51200)

# One group per kind, 8 GPUs a node: each kind's fabric as such nodes usually have it.
NODES = {
    "a100": dict(type_name="A100-80GB", inter_node=Link("HDR InfiniBand", 25e9, 5e-6), nics_per_node=8),
    "v100": dict(type_name="V100-16GB", inter_node=Link("EDR InfiniBand", 12.5e9, 5e-6), nics_per_node=4),
    "t4": dict(type_name="T4", inter_node=Link("100 Gb/s Ethernet", 12.5e9, 10e-6), nics_per_node=1),
}
BETWEEN = GroupLink(Link("100 Gb/s Ethernet", 12.5e9, 10e-6), direct=False)  # through the hosts


@dataclass(frozen=True)
class Scenario:
    name: str
    model: Transformer
    batch: int
    gpus: dict[str, int]  # kind -> count (a multiple of 8); empty: `cluster_file`
    dtype: str = "float16"
    cluster_file: str = ""

    def cluster(self) -> Cluster:
        if self.cluster_file:
            return Cluster.from_file(str(CLUSTERS / self.cluster_file))
        groups = tuple(DeviceGroup(name=kind, nodes=max(1, count // 8), devices_per_node=min(count, 8), **NODES[kind])
                       for kind, count in self.gpus.items())
        links = {frozenset((a.label, b.label)): BETWEEN for i, a in enumerate(groups) for b in groups[i + 1:]}
        return Cluster(groups, links, self.name)

    def problem(self) -> Problem:
        return problem_on(self.model, self.cluster(), self.batch, self.dtype)


def _metis(layers: int, gpus: int, kinds: int) -> Scenario:
    """Two kinds: half A100, half V100. Three: half A100, a quarter each V100 and T4
    (16 GPUs: 8 A100 and a 4-GPU node each of V100 and T4). Power-of-two counts: a
    kind's stages use all its devices, and a data-parallel degree must divide the
    microbatch (88 GPUs of a kind could only run data-parallel degrees of 11 x 2^k)."""
    split = {"a100": gpus // 2, "v100": gpus // 2} if kinds == 2 else {"a100": gpus // 2, "v100": gpus // 4, "t4": gpus // 4}
    model = Transformer(layers=layers, **METIS_GPT)
    return Scenario(f"gpt{layers}_{gpus}_{kinds}t", model, batch=8 * gpus, gpus=split)


SCENARIOS = {s.name: s for s in [
    *(_metis(layers, gpus, kinds) for kinds in (2, 3) for gpus in (16, 64, 256) for layers in (10, 34)),
    Scenario("llama140b_768_3t", LLAMA_140B, 1024, {}, dtype="bfloat16", cluster_file="three_types_768.yaml"),
]}
RESULT_KEYS = {"s64_3t_s": "gpt34_64_3t", "s256_3t_s": "gpt34_256_3t", "s768_3t_s": "llama140b_768_3t"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--finalists", type=int, default=FINALISTS, help="plans the estimator ranks (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="solves per scenario, the middle one reported (default %(default)s)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    times: dict[str, float] = {}
    mixed = 0
    for name in args.scenario or list(SCENARIOS):
        s = SCENARIOS[name]
        walls, cpus, results = [], [], []
        for _ in range(args.repeats):  # each solve on a problem of its own, as a user's run makes it
            problem = s.problem()
            started, cpu_started = time.perf_counter(), time.process_time()
            results.append(Planner(problem, top_k=1, finalists=args.finalists).solve())
            walls.append(time.perf_counter() - started)
            cpus.append(time.process_time() - cpu_started)  # this process's own CPU: steadier than wall on a shared machine
        if len({r.best.describe() for r in results}) > 1:
            raise SystemExit(f"{name}: the repeated solves chose different plans: {sorted({r.best.describe() for r in results})}")
        mid = sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]  # the middle solve, its phases with it
        result, times[name], cpu = results[mid], walls[mid], cpus[mid]
        best = result.best
        cluster = " + ".join(f"{k.count} {k.name}" for k in problem.kinds)
        alone = ", ".join(f"{kind} {rate * problem.tokens_per_example:,.0f}" for kind, rate in result.per_kind)
        spread = f" (the middle of {len(walls)} solves: {min(walls):.3f}-{max(walls):.3f})" if len(walls) > 1 else ""
        print(f"{name}: {s.model.layers} layers, batch {s.batch}, {s.dtype}, {cluster}")
        print(f"  search {times[name]:.3f} s wall{spread}, {cpu:.3f} s CPU; step {best.step_s:.4f} s (estimator); "
              f"{best.tokens_per_s:,.0f} tokens/s; "
              + ("proven best of the planner's space" if not result.gap else f"stopped at most {result.gap:.1%} from the best"))
        print(f"  where the search's time went: {result.describe_phases()}")
        if result.bound_ratio is None:
            print("  bound: none (no kind alone fits the model)")
        else:
            print(f"  bound (each kind alone, summed: {alone} tokens/s): the plan reaches {result.bound_ratio:.1%}, "
                  f"a gap of {1 - result.bound_ratio:+.1%}" + (" (above 100%: a kind alone fits the model worse than beside others)"
                                                            if result.bound_ratio > 1 else ""))
        print(f"  plan: {best.describe()}")
        mixed += best.mixed  # a stage whose data-parallel parts are of different kinds (solver/planner/mixed.py)
    print("RESULT " + " ".join(f"{key}={times[name]:.3f}" for key, name in RESULT_KEYS.items() if name in times)
          + f" mixed_stage_chosen={mixed}")


if __name__ == "__main__":
    main()

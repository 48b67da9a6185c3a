"""Every view of a plan prints the same numbers: the step time and peak memory per
device that `hetpar solve` prints (the Plan the planning passes return), `hetpar
show` (the plan saved and loaded back), `hetpar simulate` (its schedule simulated
from the loaded plan), `hetpar solve --compare` (its row), the Python API
(`hetpar.estimate_plan`) and the plan written again by hand (every predicted figure
in the file zeroed): for plans made every way hetpar makes them (the planner's,
written by hand, loaded back, `like=` an eval, uniform, interleaved) on two and three
device kinds, and an abstract Llama-2-7B.

Also counts plans the planner returned that the placement's fit check then refused
(the planner's and the placement's memory models disagreeing).

Ends with: RESULT views_max_rel_diff=<x> planner_vs_placement_fit_disagreements=<n>
Run: .venv/bin/python benchmarks/agreement.py [--quick] (--quick: no 7B)
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import hetpar  # noqa: E402
import models  # noqa: E402
from hetpar.cluster.cluster import Cluster  # noqa: E402
from hetpar.compare import compare  # noqa: E402
from hetpar.errors import PlanError  # noqa: E402
from hetpar.plan import Plan  # noqa: E402
from hetpar.plan.costs import estimate_plan  # noqa: E402
from hetpar.plan.file import load_plan, plan_from_dict, plan_to_dict, save_plan  # noqa: E402
from hetpar.timeline import simulate_plan  # noqa: E402
from solver.pipeline_sim import MAX_SIMULATED_MICROBATCHES  # noqa: E402

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
PREDICTED = ("forward_s", "backward_s", "send_s", "sync_s", "optimizer_s", "predicted_time_s", "memory_bytes")


def view_figures(plan: Plan) -> dict[str, tuple[float, float]]:
    """(step seconds, peak bytes per device) as each view reads them for `plan`."""
    out = {"solve": (plan.predicted_step_time_s, max(s.memory_bytes for s in plan.stages))}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        save_plan(plan, path)
        loaded = load_plan(path)
    out["show"] = (loaded.predicted_step_time_s, max(s.memory_bytes for s in loaded.stages))
    if loaded.num_microbatches <= MAX_SIMULATED_MICROBATCHES:
        out["simulate"] = (simulate_plan(loaded).step_s, out["show"][1])
    cost = estimate_plan(plan)
    out["api"] = (cost.step_s, int(cost.peak_memory_bytes))
    row = compare(plan.cost_inputs, single_kinds=False, solved=plan)[0]
    out["compare"] = (row.choice.step_s, row.memory_bytes)
    raw = plan_to_dict(plan)
    raw["predicted_step_time_s"] = 0.0
    for stage in raw["stages"]:
        stage.update({name: 0 for name in PREDICTED})
    by_hand = plan_from_dict(raw)
    out["by hand"] = (by_hand.predicted_step_time_s, max(s.memory_bytes for s in by_hand.stages))
    return out


def max_rel_diff(figures: dict[str, tuple[float, float]]) -> float:
    worst = 0.0
    for k in (0, 1):
        values = [v[k] for v in figures.values()]
        top = max(abs(v) for v in values)
        if top:
            worst = max(worst, (max(values) - min(values)) / top)
    return worst


def small_plans() -> dict[str, Plan]:
    """The examples' small GPT planned every way, on two and three device kinds."""
    w = models.get("gpt", batch_size=8)
    two = Cluster.from_file(str(CLUSTERS / "virtual_8.yaml"))
    three = Cluster.virtual({"H100": 2, "A100": 2, "V100": 4})
    args = (w.state, w.batch)
    plans = {
        "auto, 2 kinds": hetpar.make_plan(w.step, args, two, num_microbatches=2),
        "auto, 3 kinds": hetpar.make_plan(w.step, args, three, num_microbatches=2),
        "manual 2 stages": hetpar.make_plan(w.step, args, two, num_microbatches=4, num_stages=2),
        "uniform 2 stages": hetpar.make_plan(w.step, args, two, num_microbatches=4,
                                             stage_option=hetpar.StageOption(mode="uniform", num_stages=2)),
        "interleaved 2x2": hetpar.make_plan(w.step, args, two, num_microbatches=4, num_stages=2, schedule="interleaved",
                                            chunks=2),
        "replicas": hetpar.make_plan(w.step, args, two, num_microbatches=2, num_replicas=2),
    }
    train = hetpar.parallelize(w.step, cluster=two, num_microbatches=2, num_stages=2)
    state, _ = train(w.state, w.batch)

    def evaluate(state, batch):
        return w.loss_fn(state.params, batch)

    ev = hetpar.parallelize(evaluate, like=train)
    ev(state, w.batch)
    plans["like= eval"] = ev.plan
    return plans


def abstract_7b(disagreements: list[str]) -> dict[str, Plan]:
    """Llama-2-7B (f32 parameters, bf16 compute) on V100s and on two kinds, planned abstractly."""
    from hetpar.pipeline import solve
    from hetpar.trace.traced_step import trace_step
    from models import llama

    out = {}
    for name, batch in (("v100_32.yaml", 64), ("two_types.yaml", 64)):
        cluster = Cluster.from_file(str(CLUSTERS / name)).numbered()
        w = llama.setup(batch, llama.LLAMA2_7B, abstract=True)
        traced = trace_step(w.step, (w.state, w.batch), 1, 1)
        try:
            out[f"llama2-7b on {name}"] = solve(traced, cluster, search_microbatches=True)
        except PlanError as e:
            if "does not fit in memory" in str(e):
                disagreements.append(f"llama2-7b on {name}: {e}")
            else:
                raise
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    disagreements: list[str] = []
    plans = small_plans()
    if not args.quick:
        plans.update(abstract_7b(disagreements))
    worst = 0.0
    for name, plan in plans.items():
        figures = view_figures(plan)
        diff = max_rel_diff(figures)
        worst = max(worst, diff)
        print(f"{name}: {plan.num_stages} stages, {plan.schedule} x{plan.chunks}, m={plan.num_microbatches}")
        for view, (step, memory) in figures.items():
            print(f"    {view:<9} step {step:.9g} s   peak {memory / 2**20:12.4f} MiB")
        print(f"    max relative difference {diff:.2e}")
    for line in disagreements:
        print("fit disagreement:", line)
    print(f"RESULT views_max_rel_diff={worst:.3g} planner_vs_placement_fit_disagreements={len(disagreements)}")


if __name__ == "__main__":
    main()

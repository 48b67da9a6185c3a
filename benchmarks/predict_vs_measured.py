"""Plans predicted from measured layer profiles against the same plans run.

1. Layer profiles made here (`hetpar.predict.layer_profile.layer_timing`, what
   `hetpar profile --layers` runs): each distinct layer of the benchmark GPT
   (benchmarks/step_timing.gpt_benchmark: d_model 128, 4 heads, 64 tokens, 4 blocks,
   cut into 6 layers: embedding, 4 blocks, head) timed on meshes of the data- and
   tensor-parallel degrees the plans use, at the examples per device they run (at
   tp > 1 laid out by the sharding pass, `hetpar.predict.tp_profile`).
2. Plans fixed by hand on a virtual cluster of two device groups ("a": devices 0-3,
   "b": 4-7, both this host's CPU): 1F1B and interleaved, 2 to 4 stages, data-parallel
   pipelines side by side, several microbatch counts, one plan whose stages have a
   model axis (2 x 2, data x model). Each is made by
   `hetpar.parallelize(..., profile=F)` and priced by the one estimator
   (`plan.predicted_step_time_s`); the same decisions are priced again without the
   layer records (the roofline and the catalog's CPU figures, pipeline stages side by
   side) for comparison.
3. Every plan is run and timed, and the layer profile timed again beside it: after
   warm-up, rounds in which each plan runs a few steps and the profile runs each of its
   layer programs once, in turn (order rotated every round:
   benchmarks/step_timing.interleaved_rounds); per plan the median over rounds of each
   round's median, per layer program the median over rounds. The plans are made with a
   first quick profile (which layers each stage holds) and priced with the one timed
   beside them: on this shared host the same program's CPU time moved by 1.6x between a
   profile made before the steps and the steps (5.5 against 8.8 ms for one block's
   forward on 2 devices), which a profile minutes apart from the steps prices as error.

Which clock: CPU virtual devices are this host's cores, shared with whatever else runs
here. The profile and the steps are timed on the same clock, the process's CPU time
(all its threads: every virtual device's work; hetpar.predict.timing explains why wall
time on a loaded 2-core host mostly measures the neighbours). A shared host runs its
devices' work one after another, so the estimator prices a step there as the sum of
its stages' work (`solver.cost.estimate.serial_step_s`). Wall times are printed beside
the CPU times for reference only, with `uptime`'s load.

Ends with: RESULT median_abs_err=<x> max_abs_err=<y> plans=<n>  (relative errors of the
profile-priced prediction against the measured CPU time)
Run: PYTHONPATH=. .venv/bin/python benchmarks/predict_vs_measured.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hetpar  # noqa: E402
from hetpar.cluster.cluster import Cluster  # noqa: E402
from hetpar.cluster.groups import DeviceGroup  # noqa: E402
from hetpar.plan.costs import estimate_plan  # noqa: E402
from hetpar.predict.layer_profile import layer_timing  # noqa: E402
from hetpar.predict.tp_profile import Pooled  # noqa: E402
from hetpar.predict.timing import busy_clock, median_times  # noqa: E402
from hetpar.predict.profile import Profile  # noqa: E402
from hetpar.runtime.host_cost import host_runs  # noqa: E402
from hetpar.shard import shard_stages  # noqa: E402
from step_timing import Stepper, gpt_benchmark, interleaved_rounds  # noqa: E402

NUM_LAYERS = 6  # embedding, 4 blocks, head
# (label, options for hetpar.parallelize)
PLANS = [
    ("2 stages 1F1B m=4", dict(num_stages=2, num_microbatches=4, schedule="1f1b")),
    ("2 stages 1F1B m=2", dict(num_stages=2, num_microbatches=2, schedule="1f1b")),
    ("2 stages 1F1B m=8", dict(num_stages=2, num_microbatches=8, schedule="1f1b")),
    ("4 stages 1F1B m=4", dict(num_stages=4, num_microbatches=4, schedule="1f1b")),
    ("4 stages interleaved (2 groups x 2 chunks) m=4", dict(num_stages=2, num_microbatches=4, schedule="interleaved", chunks=2)),
    ("4 stages interleaved (2 groups x 2 chunks) m=8", dict(num_stages=2, num_microbatches=8, schedule="interleaved", chunks=2)),
    ("2 data-parallel pipelines x 1 stage m=2", dict(num_replicas=2, num_stages=1, num_microbatches=2)),
    ("2 data-parallel pipelines x 2 stages m=2", dict(num_replicas=2, num_stages=2, num_microbatches=2, schedule="1f1b")),
    ("3 stages 1F1B m=4", dict(num_stages=3, num_microbatches=4, schedule="1f1b")),
    ("2 stages 1F1B m=4, each 2x2 (data x model)", dict(num_stages=2, num_microbatches=4, schedule="1f1b", mesh_shape=(2, 2))),
]


def two_groups() -> Cluster:
    """This host's 8 CPU devices as two device groups of 4."""
    groups = (DeviceGroup("cpu", (0, 1, 2, 3), name="a", devices_per_node=4),
              DeviceGroup("cpu", (4, 5, 6, 7), name="b", devices_per_node=4))
    return Cluster(groups, name="virtual")


def without_layers(plan):  # noqa: ANN001, ANN201
    """`plan`'s decisions priced by the estimator without the layer records."""
    inputs = plan.cost_inputs
    kinds = tuple(replace(k, shared_host=False) for k in inputs.kinds)
    return estimate_plan(replace(plan, cost_inputs=replace(inputs, measured_layers=(), kinds=kinds))).step_s


def main() -> None:
    args, w = gpt_benchmark(__doc__.splitlines()[0], iters=3, rounds=9)
    cluster = two_groups()
    batch = args.batch_size
    print(f"load before: {os.getloadavg()}")

    # 1. Which (tensor-parallel degree, data-parallel degree, examples per device) the plans
    # run: a plan on the cluster is made first without a profile, only to read its meshes and microbatch.
    shapes = set()
    for _, options in PLANS:
        plan = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_layers=NUM_LAYERS, **options)
        for s in plan.stages:
            share = sum(plan.replica_batch) and plan.replica_batch[s.replica] or batch
            dp = s.num_devices // s.tensor_parallel
            shapes.add((s.tensor_parallel, dp, share // plan.num_microbatches // dp))
    parts = []
    start = time.perf_counter()
    for tp in sorted({tp for tp, _, _ in shapes}):  # each degree its own meshes and sizes, not all crossed
        dps = sorted({dp for t, dp, _ in shapes if t == tp})
        examples = sorted({e for t, _, e in shapes if t == tp})
        print(f"profiling layers at tensor-parallel degree {tp} on meshes of {dps} x {tp} devices at {examples} "
              f"examples per device")
        parts.append(layer_timing(w.step, (w.state, w.batch), list(range(8)), "cpu", examples, dps, NUM_LAYERS, remat=False,
                                  host=host_runs, tensor_parallel=(tp,), shard=shard_stages))
    timing = parts[0] if len(parts) == 1 else Pooled(parts)
    clock = busy_clock("cpu")
    # A first profile, only to make the plans with (which layers each stage holds).
    first = Path(tempfile.mkdtemp()) / "first.json"
    Profile({}, layers=timing.records(median_times(timing.runs, rounds=3, clock=clock))).save(first)
    print(f"first profile: {len(timing.runs)} layer runs in {time.perf_counter() - start:.0f} s")

    # 2. The plans, made with the first profile.
    steppers, plans = {}, {}
    for label, options in PLANS:
        step = hetpar.parallelize(w.step, cluster=cluster, num_layers=NUM_LAYERS, profile=str(first), **options)
        stepper = Stepper(step, w.state, w.batch)
        stepper.warm_up(3)
        steppers[label], plans[label] = stepper, step.plan

    # 3. The profile and the steps timed in the same rounds (order rotated every round),
    # so that both see the same moments of the shared machine.
    contenders = {"layers": ProfileRuns(timing.runs, clock), **steppers}
    loads = [os.getloadavg()[0]]
    rounds = interleaved_rounds(contenders, args.rounds, args.iters)
    loads.append(os.getloadavg()[0])
    records = timing.records(contenders["layers"].medians())
    for r in records:
        points = "; ".join(f"{p.examples}/dev {p.forward_s * 1e3:.2f}+{p.backward_s * 1e3:.2f} ms"
                           + (f" (one program {p.fused_s * 1e3:.2f} ms)" if p.fused_s else "")
                           + f", send {p.send_s * 1e3:.2f} ms, per program {p.stage_program_s * 1e3:.2f} ms"
                           for p in r.points)
        print(f"  {r.name:<12} on {r.dp}x{r.tp} devices: launch {r.program_s * 1e3:.2f} ms, per stage program "
              f"{r.stage_program_s * 1e3:.2f} ms, merge {r.merge_s * 1e3:.2f} ms, once {r.points[0].once_s * 1e3:.2f} ms "
              f"({r.once_programs} programs), runtime per dispatch {r.dispatch_s * 1e3:.2f} ms, batch split "
              f"{r.points[0].split_s * 1e3:.2f} ms; fwd+bwd {points}")
    path = Path(tempfile.mkdtemp()) / "layers.json"
    Profile({}, layers=records).save(path)

    # 4. Each plan's decisions priced by the estimator with the profile timed beside its
    # steps (and without any layer records, for comparison).
    errors = []
    print(f"{'plan':<48} {'with profile':>12} {'without':>10} {'measured':>10} {'err':>7} {'wall':>9}  stages")
    for label, options in PLANS:
        plan = plans[label]
        inputs = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_layers=NUM_LAYERS, profile=str(path),
                                  **options).cost_inputs
        priced = replace(plan, cost_inputs=inputs)
        predicted = estimate_plan(priced).step_s
        cpu = statistics.median(rounds.cpu[label])
        wall = statistics.median(rounds.wall[label])
        err = (predicted - cpu) / cpu
        errors.append(abs(err))
        stages = " | ".join(f"{s.group}:{s.layer_start}-{s.layer_end - 1}x{s.num_devices}"
                            + (f" (tp {s.tensor_parallel})" if s.tensor_parallel > 1 else "") for s in plan.stages)
        print(f"{label:<48} {predicted * 1e3:>9.1f} ms {without_layers(priced) * 1e3:>7.1f} ms {cpu * 1e3:>7.1f} ms "
              f"{err:>+7.1%} {wall * 1e3:>6.1f} ms  {stages}")
    print(f"uptime load average during timing: {statistics.mean(loads):.2f} (2 cores); after: {os.getloadavg()}")
    print(f"RESULT median_abs_err={statistics.median(errors):.3f} max_abs_err={max(errors):.3f} plans={len(errors)}")


class ProfileRuns:
    """The layer profile's runs as one contender of `interleaved_rounds`: each round
    times every run once (in an order rotated every round), on the profile's clock."""

    def __init__(self, runs: list, clock: Callable[[], float]):
        self.runs, self.clock = runs, clock
        self.seen: list[list[float]] = [[] for _ in runs]
        self.round = 0

    def times(self, calls: int) -> tuple[list[float], list[float]]:
        n = len(self.runs)
        for k in range(n):
            i = (k + self.round) % n
            start = self.clock()
            jax.block_until_ready(self.runs[i]())
            self.seen[i].append(self.clock() - start)
        self.round += 1
        return [0.0], [0.0]

    def medians(self) -> list[float]:
        return [statistics.median(s) for s in self.seen]


if __name__ == "__main__":
    main()

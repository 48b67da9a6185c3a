"""What the runtime needs of a plan, checked before anyone tries to run it: every
pipeline covers the layers exactly once, in order; no device serves two stages (but
the chunks of one device group under an interleaved schedule); the
batch splits into whole microbatches per pipeline; and each stage's data axis divides
the examples of the microbatch it receives (a data-parallel device cannot run a
fraction of an example).

The planner only builds plans that pass; this is the last line that says so, with
the problem and the fix, instead of a shape error deep in the runtime."""

from __future__ import annotations

import math

from hetpar.errors import PlanError
from hetpar.plan.model import Plan


def runnable_problems(plan: Plan, batch_size: int) -> list[str]:
    """Everything that keeps `plan` from running on a batch of `batch_size`, in words."""
    problems: list[str] = []
    m = plan.num_microbatches
    shares = plan.replica_batch or (batch_size,)
    if sum(shares) != batch_size:
        problems.append(f"the pipelines take {list(shares)} examples, not the batch's {batch_size}")
    owner: dict[int, int] = {}
    for s in plan.stages:
        # An interleaved plan's later chunks run on their group's devices (checked by hetpar.plan.file._check_chunks).
        for d in s.device_ids if s.chunk == 0 else ():
            if d in owner:
                problems.append(f"device {d} is in stage {owner[d]} and stage {s.index}")
            owner[d] = s.index
        if s.mesh_shape and math.prod(s.mesh_shape) != s.num_devices:
            problems.append(f"stage {s.index}'s mesh {s.mesh_shape} does not hold its {s.num_devices} devices")
    for r, share in enumerate(shares):
        stages = sorted(plan.replica_stages(r), key=lambda s: s.index)
        ranges = [(s.layer_start, s.layer_end) for s in stages]
        expected = list(zip([0] + [e for _, e in ranges[:-1]], [e for _, e in ranges]))
        if not stages or ranges != expected or ranges[-1][1] != plan.num_layers or any(a >= b for a, b in ranges):
            problems.append(f"pipeline {r}'s stages hold layers {ranges}, not each of the {plan.num_layers} layers once in order")
        if share % m:
            problems.append(f"pipeline {r}'s {share} examples do not split into {m} microbatches")
            continue
        micro = share // m
        for s in stages:
            dp = s.data_parallel or s.num_devices
            if micro % dp:
                problems.append(f"stage {s.index} splits its microbatch of {micro} examples {dp} ways")
    return problems


def check_runnable(plan: Plan, batch_size: int) -> None:
    """Raises PlanError naming what the runtime could not run."""
    problems = runnable_problems(plan, batch_size)
    if problems:
        raise PlanError("the plan cannot run: " + "; ".join(problems) + ". Choose a microbatch count or batch size that "
                        "the stages' data-parallel degrees divide, or let the planner choose the plan")

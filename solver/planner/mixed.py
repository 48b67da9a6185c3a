"""Mixed-kind stages in the planner: a pipeline stage whose data-parallel parts sit on
devices of two or three kinds, each part taking rows of every microbatch in
proportion to its speed (Metis's load balancer, HETHUB's and Whale's split).

The search's space has one kind per stage. Its finalists are then widened here: where
a finalist leaves devices idle (a kind too slow or too small to hold a stage of its
own, or the rest of a kind a stage did not use), each stage is tried with one or two
idle kinds as extra parts (each with its fastest meshes that hold the layers), as
split and with up to `MAX_SHIFT` more layers taken from a neighbour (the stage got
faster). Adjacent stages of different kinds are also tried as one mixed stage over both
their layers and both their meshes. The rows follow the parts' speeds (whole
examples, a multiple of each part's data-parallel degree as the search gives a stage). Every variant is priced by the one
estimator (`solver.cost.estimate`: the slowest part's rows set the stage's time, the
parts' gradients are summed with the all-reduce their links favour, each part's
memory must fit), and kept only where it is faster than the finalist it came from.
So the planner chooses a mixed stage exactly when the estimator says it wins.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Sequence

import numpy as np

from solver.cost.estimate import estimate
from solver.cost.problem import PlanningError, Problem
from solver.cost.stage_costs import StageConfig, StageCosts
from solver.planner.problem import PlanChoice, StageChoice
from solver.planner.step import decisions

MIXED_FINALISTS = 2  # single-chunk finalists widened with mixed stages (the best few: the rest rarely overtake them)
MAX_PART_KINDS = 2  # idle kinds joined to one stage: a stage of at most three kinds
MAX_SHIFT = 2  # layers a mixed stage may take from a neighbour beyond the finalist's split
LAYOUTS_PER_KIND = 1  # an idle kind's fastest meshes tried as a part
COARSER = 1  # microbatch counts halved this many times beside the finalist's


def proportional_examples(size: int, speeds: Sequence[float], least: Sequence[int] | int = 1,
                          unit: Sequence[int] | int = 1) -> tuple[int, ...]:
    """`size` rows split in proportion to `speeds`, whole examples: each part at least
    `least` and a multiple of `unit` rows (one number, or one per part: the planner
    gives a part a multiple of its data-parallel degree, as the search gives a stage).
    From each part's least, every `unit` left goes where it finishes soonest (the
    least (rows + unit) / speed; ties to the part furthest below its share), which
    keeps the slowest part, and so the stage, as fast as whole examples allow."""
    n = len(speeds)
    units = [unit] * n if isinstance(unit, int) else list(unit)
    floors = [least] * n if isinstance(least, int) else list(least)
    counts = [-(-max(f, 1) // u) * u for f, u in zip(floors, units)]  # the least, rounded up to whole units
    if size < sum(counts):
        raise PlanningError(f"a microbatch of {size} examples cannot give the parts at least {counts} each")
    total = sum(speeds)
    ideal = [size * v / total for v in speeds]
    left = size - sum(counts)
    while left:
        fits = [i for i in range(n) if units[i] <= left]
        if not fits:
            raise PlanningError(f"{size} examples do not split into parts of multiples of {units} rows")
        i = min(fits, key=lambda i: ((counts[i] + units[i]) / speeds[i], counts[i] - ideal[i]))
        counts[i] += units[i]
        left -= units[i]
    return tuple(counts)


def with_mixed_stages(problem: Problem, found: list[PlanChoice], costs: StageCosts) -> list[PlanChoice]:
    """`found` (ranked by the estimator) with the best mixed variant of each of its
    first `MIXED_FINALISTS` single-chunk pipelines added where it is faster, ranked again."""
    if len(problem.kinds) < 2 or not problem.allow_mixed:
        return found
    plain = [c for c in found if c.chunks == 1 and len(c.replica_batch) == 1][:MIXED_FINALISTS]
    extra = [v for c in plain if (v := best_mixed(problem, c, costs)) is not None]
    return sorted([*found, *extra], key=lambda c: c.step_s) if extra else found


def idle_devices(problem: Problem, choice: PlanChoice) -> dict[str, int]:
    """Devices of each kind no stage of `choice` runs on (a group's chunks share theirs)."""
    used: dict[str, int] = {}
    for s in choice.stages[: len(choice.stages) // choice.chunks]:
        used[s.kind] = used.get(s.kind, 0) + s.devices
    return {k.name: k.count - used.get(k.name, 0) for k in problem.kinds if k.count > used.get(k.name, 0)}


def best_mixed(problem: Problem, choice: PlanChoice, costs: StageCosts) -> PlanChoice | None:
    """The fastest variant of `choice` with one stage mixed with idle devices (and
    taking up to `MAX_SHIFT` more layers from a neighbour, since it got faster), if
    one beats it under the estimator; None otherwise. Single pipelines without
    interleaving only (the runtime's mixed stages have one chunk)."""
    if choice.chunks > 1 or len(choice.replica_batch) > 1 or choice.mixed:
        return None
    idle = idle_devices(problem, choice)
    best, best_s = None, choice.step_s
    for m in _coarser(problem, choice):
        b = choice.replica_batch[0] // m
        for p in range(len(choice.stages)):
            for base in _grown(replace(choice, num_microbatches=m), p):
                stage = base.stages[p]
                layouts = {k: _layouts(problem, costs, k, n, stage, b)[:LAYOUTS_PER_KIND] for k, n in idle.items()}
                layouts = {k: v for k, v in layouts.items() if v}
                for r in range(1, min(MAX_PART_KINDS, len(layouts)) + 1):
                    for kinds in itertools.combinations(sorted(layouts), r):
                        for parts in itertools.product(*(layouts[k] for k in kinds)):
                            candidate = _mixed(base, p, list(parts), b, costs)
                            if candidate is None:
                                continue
                            cost = estimate(problem, decisions(candidate), costs)
                            if cost.fits and cost.step_s < best_s:
                                best, best_s = _with_costs(candidate, cost), cost.step_s
    for m in _coarser(problem, choice):
        for p in range(len(choice.stages) - 1):
            candidate = _merged(problem, replace(choice, num_microbatches=m), p, costs)
            if candidate is not None:
                cost = estimate(problem, decisions(candidate), costs)
                if cost.fits and cost.step_s < best_s:
                    best, best_s = _with_costs(candidate, cost), cost.step_s
    return best


def _merged(problem: Problem, choice: PlanChoice, p: int, costs: StageCosts) -> PlanChoice | None:
    """`choice` with stages p and p + 1, of different kinds, made one mixed stage over
    both their layers on both their meshes (one pipeline stage fewer: less bubble, and
    the two kinds share every layer in proportion to their speed), as Metis puts V100
    and T4 nodes in one stage."""
    a, c = choice.stages[p], choice.stages[p + 1]
    if a.kind == c.kind:
        return None
    b = choice.replica_batch[0] // choice.num_microbatches
    joined = replace(a, layer_end=c.layer_end, remat=a.remat or c.remat)
    parts = []
    for s in (a, c):
        cfg = StageConfig(s.kind, s.dp, s.tp)
        v = costs.variant(cfg, b, 1, False, s.zero, "full" if joined.remat else "")
        seconds = _at(v.forward, v.forward.shape, joined.layer_start, joined.layer_end) + _at(
            v.backward, v.forward.shape, joined.layer_start, joined.layer_end)
        parts.append((cfg, s.zero, b / seconds if seconds > 0 else 1.0))
    try:
        rows = proportional_examples(b, [speed for _, _, speed in parts], unit=[parts[0][0].dp, parts[1][0].dp])
    except PlanningError:
        return None
    stages = [*choice.stages[:p], replace(joined, examples=rows[0]), *choice.stages[p + 2:]]
    stages.append(replace(joined, kind=c.kind, dp=c.dp, tp=c.tp, zero=c.zero, offload=c.offload, part_of=p, examples=rows[1]))
    return replace(choice, stages=tuple(stages))


def _coarser(problem: Problem, choice: PlanChoice) -> list[int]:
    """The finalist's microbatch count and up to two coarser ones the problem allows:
    a part's share is whole examples, so larger microbatches split closer to speed."""
    batch, m = choice.replica_batch[0], choice.num_microbatches
    allowed = problem.microbatches
    out = []
    for k in range(COARSER + 1):
        n = m >> k
        if n >= 1 and batch % n == 0 and (allowed is None or n in allowed) and batch // n >= problem.min_microbatch:
            out.append(n)
    return list(dict.fromkeys(out))


def _grown(choice: PlanChoice, p: int) -> list[PlanChoice]:
    """`choice`, and `choice` with stage `p` taking 1..MAX_SHIFT layers from the stage
    before or after it (each keeps one at least)."""
    out = [choice]
    stages = choice.stages
    for k in range(1, MAX_SHIFT + 1):
        if p > 0 and stages[p - 1].layer_end - k > stages[p - 1].layer_start:
            moved = list(stages)
            moved[p - 1] = replace(stages[p - 1], layer_end=stages[p - 1].layer_end - k)
            moved[p] = replace(stages[p], layer_start=stages[p].layer_start - k)
            out.append(replace(choice, stages=tuple(moved)))
        if p + 1 < len(stages) and stages[p + 1].layer_start + k < stages[p + 1].layer_end:
            moved = list(stages)
            moved[p + 1] = replace(stages[p + 1], layer_start=stages[p + 1].layer_start + k)
            moved[p] = replace(stages[p], layer_end=stages[p].layer_end + k)
            out.append(replace(choice, stages=tuple(moved)))
    return out


def _layouts(problem: Problem, costs: StageCosts, kind: str, devices: int, stage: StageChoice,
             b: int) -> list[tuple[StageConfig, int, float]]:
    """The idle `devices` of `kind` as each allowed (dp, tp) mesh (tensor parallelism
    within a node) that holds the stage's layers at a microbatch of `b` rows with the
    least ZeRO stage that fits: (mesh, ZeRO stage, examples per second)."""
    k = problem.kind(kind)
    i, j = stage.layer_start, stage.layer_end
    remat = "full" if stage.remat else ""
    out = []
    for tp in (t for t in (1, 2, 4, 8) if t <= min(problem.max_tp, k.devices_per_node) and devices % t == 0):
        cfg = StageConfig(kind, devices // tp, tp)
        if 2 * cfg.dp > b:  # a row per data-parallel device, and the lead keeps at least half
            continue
        share = max(cfg.dp, b * cfg.devices // max(1, devices + stage.devices))  # about the rows it would take
        for zero in sorted(z for z in problem.zero_stages if z == 0 or cfg.dp > 1):
            v = costs.variant(cfg, share, 1, False, zero, remat)
            if _at(v.memory.total, v.forward.shape, i, j) > costs.capacity(kind):
                continue
            seconds = _at(v.forward, v.forward.shape, i, j) + _at(v.backward, v.forward.shape, i, j)
            if seconds > 0:
                out.append((cfg, zero, share / seconds))
            break
    return sorted(out, key=lambda layout: -layout[2])


def _at(x, shape: tuple, i: int, j: int) -> float:  # noqa: ANN001
    return float(np.broadcast_to(x, shape)[i, j])


def _mixed(choice: PlanChoice, p: int, parts: list[tuple[StageConfig, int, float]], b: int,
           costs: StageCosts) -> PlanChoice | None:
    """`choice` with stage `p` joined by `parts` (mesh, ZeRO stage, examples per
    second), rows by speed, at least one per data-parallel device."""
    lead = choice.stages[p]
    cfg = StageConfig(lead.kind, lead.dp, lead.tp)
    v = costs.variant(cfg, b, 1, False, lead.zero, "full" if lead.remat else "")
    seconds = _at(v.forward, v.forward.shape, lead.layer_start, lead.layer_end) + _at(v.backward, v.forward.shape,
                                                                                     lead.layer_start, lead.layer_end)
    speeds = [b / seconds if seconds > 0 else 1.0, *(speed for _, _, speed in parts)]
    try:
        rows = proportional_examples(b, speeds, unit=[lead.dp, *(c.dp for c, _, _ in parts)])
    except PlanningError:
        return None
    stages = list(choice.stages)
    stages[p] = replace(lead, examples=rows[0])
    for (c, zero, _), n in zip(parts, rows[1:]):
        stages.append(replace(lead, kind=c.kind, dp=c.dp, tp=c.tp, zero=zero, offload="", part_of=p, examples=n))
    return replace(choice, stages=tuple(stages))


def _with_costs(choice: PlanChoice, cost) -> PlanChoice:  # noqa: ANN001
    """`choice` with each stage's figures and the step the estimator's."""
    stages = tuple(replace(s, forward_s=c.forward_s, backward_s=c.backward_s, send_s=c.send_s, sync_s=c.sync_s,
                           optimizer_s=c.optimizer_s, memory_bytes=int(c.group_memory_bytes), memory_capacity=c.capacity)
                   for s, c in zip(choice.stages, cost.stages))
    return replace(choice, stages=stages, step_s=cost.step_s, peak_flops=cost.peak_flops)

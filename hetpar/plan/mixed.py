"""Mixed-kind stages by hand: one stage of a plan split into data-parallel parts on
devices of different kinds, each taking its rows of every microbatch.

The plan is the contract (`StagePlan.part_of`, `StagePlan.examples`): the stage keeps
its index and becomes the first part (its lead, which `operator_stages` names), every
other part is appended as a stage of its own. Compile cuts each part's copy of the
stage's forward and backward at its rows (compile/step.mixed_rows), the runtime core
splits and joins the rows (runtime/mixed.py), and the one estimator prices it
(solver/cost/mixed.py). The planner makes the same plans (solver/planner/mixed.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from hetpar.cluster.catalog import device_type
from hetpar.errors import PlanError
from hetpar.plan.costs import priced
from hetpar.plan.file import check_plan
from hetpar.plan.model import Plan, StagePlan
from solver.cost.problem import PlanningError
from solver.planner.mixed import proportional_examples as _proportional


@dataclass(frozen=True)
class Part:
    """One part of a mixed stage: devices of one cluster group (positions in the
    cluster's device order), as a mesh (`mesh_shape`: data[, model]; () all data
    parallel), taking `examples` rows of every microbatch."""

    group: str
    devices: tuple[int, ...]
    examples: int
    mesh_shape: tuple[int, ...] = ()


def mix_stage(plan: Plan, stage: int, parts: Sequence[Part]) -> Plan:
    """`plan` with stage `stage` split into `parts` (the first takes the stage's place),
    priced by the estimator. Refuses what cannot run, naming the fix."""
    by_index = {s.index: s for s in plan.stages}
    if stage not in by_index or by_index[stage].is_part or plan.parts(stage):
        raise PlanError(f"stage {stage} is not an unmixed stage of this plan (stages 0..{plan.num_stages - 1}); "
                        f"split a stage once")
    if len(parts) < 2:
        raise PlanError(f"a mixed stage needs at least two parts, got {len(parts)}")
    if plan.chunks > 1:
        raise PlanError("mixed-kind stages under an interleaved schedule are not supported; use one chunk per device group")
    kinds = {g.name: g.device_type for g in plan.cluster_groups}
    old = by_index[stage]
    others = {d for s in plan.stages if s.index != stage for d in s.device_ids}
    total = sum(p.examples for p in parts)
    stages = list(plan.stages)
    for k, part in enumerate(parts):
        if part.group not in kinds:
            raise PlanError(f"part {k} names cluster group {part.group!r}; the plan's groups are {', '.join(kinds)}")
        if not part.devices or set(part.devices) & others:
            raise PlanError(f"part {k}'s devices {list(part.devices)} are none or used by another stage; give it devices of its own")
        shape = tuple(part.mesh_shape) or (len(part.devices),)
        if math.prod(shape) != len(part.devices):
            raise PlanError(f"part {k}'s mesh_shape {list(shape)} does not hold its {len(part.devices)} devices")
        if len(shape) != len(old.mesh_shape or (old.num_devices,)) and old.shardings:
            raise PlanError(f"part {k}'s mesh has {len(shape)} axes but stage {stage}'s layouts were solved for "
                            f"{len(old.mesh_shape)}: give every part a mesh with the stage's axes")
        kind = kinds[part.group]
        made = replace(
            old, index=stage if k == 0 else len(stages), device_type=kind, device_ids=tuple(part.devices), group=part.group,
            mesh_shape=shape, data_parallel=shape[0], tensor_parallel=math.prod(shape[1:]),
            flops=old.flops * part.examples / max(total, 1),
            speed_flops=len(part.devices) * device_type(kind).matmul_flops(),
            memory_capacity=device_type(kind).memory_bytes, part_of=-1 if k == 0 else stage, examples=part.examples,
        )
        if k == 0:
            stages[[s.index for s in stages].index(stage)] = made
        else:
            stages.append(made)
    out = replace(plan, stages=tuple(stages))
    check_plan(out, "mixed plan")
    return priced(out)


def proportional_examples(size: int, speeds: Sequence[float], least: int = 1) -> tuple[int, ...]:
    """`size` rows split in proportion to `speeds`, whole examples, at least `least`
    each (every row left given where it finishes soonest): what each part of a mixed
    stage takes, as the planner splits them (solver/planner/mixed.py). A part of one example traces differently
    from the batch in many models: give parts two or more."""
    try:
        return _proportional(size, speeds, least)
    except PlanningError as e:
        raise PlanError(str(e)) from None

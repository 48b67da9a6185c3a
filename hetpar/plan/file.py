"""Plans as versioned JSON files: made offline, kept in version control, loaded on
the cluster. Loading checks everything a person could have got wrong by hand and
says what, so a bad file never reaches the runtime."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any

from hetpar.cluster.catalog import device_type
from hetpar.errors import ClusterError, PlanError
from pydantic import TypeAdapter, ValidationError

from hetpar.plan.costs import priced
from hetpar.plan.model import ClusterGroup, Plan, ProgramSignature, StagePlan
from hetpar.plan.schema import PLAN_VERSION, check_plan_json
from solver import schedules
from solver.memory import OFFLOAD_TIERS
from solver.cost.problem import Problem
from solver.cost.estimate import ESTIMATOR_VERSION

_PROBLEM = TypeAdapter(Problem)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data (lists, not tuples). Its predicted figures go along
    as a cache, marked with the estimator that made them; loading prices the plan
    again from its cost inputs."""
    return json.loads(json.dumps({"version": PLAN_VERSION, "estimator_version": ESTIMATOR_VERSION, **asdict(plan)}))


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(plan_to_dict(plan), indent=1) + "\n")


def load_plan(path: str | Path) -> Plan:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PlanError(f"cannot read plan {path}: {e.strerror}") from None
    check_plan_json(data, str(path))  # every field's type and range (schema.py)
    text = data.decode()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); was the file cut short?") from None
    return plan_from_dict(raw, str(path))


def plan_from_dict(raw: Any, where: str = "plan") -> Plan:
    if not isinstance(raw, dict):
        raise PlanError(f"{where}: a plan is a JSON object, found {type(raw).__name__}")
    version = raw.get("version")
    if version != PLAN_VERSION:
        raise PlanError(f"{where} has plan format version {version!r}; this hetpar reads version {PLAN_VERSION}: solve the plan again")
    stages = tuple(_build(StagePlan, s, f"{where}: stage {i}") for i, s in enumerate(_list(raw, "stages", where)))
    groups = tuple(_build(ClusterGroup, g, f"{where}: cluster group {i}") for i, g in enumerate(raw.get("cluster_groups", [])))
    program = _build(ProgramSignature, raw["program"], f"{where}: program") if raw.get("program") else None
    inputs = _cost_inputs(raw["cost_inputs"], f"{where}: cost_inputs") if raw.get("cost_inputs") is not None else None
    top = {k: v for k, v in raw.items() if k not in ("version", "estimator_version", "stages", "cluster_groups", "program",
                                                     "cost_inputs")}
    plan = _build(Plan, {**top, "stages": stages, "cluster_groups": groups, "program": program, "cost_inputs": inputs}, where)
    try:
        check_plan(plan, where)
    except TypeError:
        raise PlanError(f"{where}: a field has the wrong type (numbers must be numbers, lists lists)") from None
    return priced(plan)  # the file's figures are a cache: every view reads the estimator's


def _cost_inputs(raw: Any, where: str) -> Problem:
    """The estimator's inputs from JSON, each field checked against the dataclasses
    (`solver.planner.Problem`, its layers and device kinds)."""
    try:
        return _PROBLEM.validate_python(raw)
    except ValidationError as e:
        first = e.errors()[0]
        path = ".".join(str(part) for part in first["loc"])
        raise PlanError(f"{where}.{path}: {first['msg']}; solve the plan again") from None


def check_plan(plan: Plan, where: str = "plan") -> None:
    """Refuses a plan that cannot run: every figure a hand edit could break."""
    if not plan.stages:
        raise PlanError(f"{where}: the plan has no stages")
    if plan.num_microbatches < 1:
        raise PlanError(f"{where}: num_microbatches must be at least 1, got {plan.num_microbatches}")
    if plan.schedule not in schedules.names():
        raise PlanError(f"{where}: unknown schedule {plan.schedule!r}; use one of {', '.join(schedules.names())}")
    for g in plan.cluster_groups:
        _known_type(g.device_type, f"{where}: cluster group {g.name!r}")
        if g.devices < 1:
            raise PlanError(f"{where}: cluster group {g.name!r} has {g.devices} devices; a group needs at least one")
    replicas = sorted({s.replica for s in plan.stages})
    if replicas != list(range(len(replicas))):
        raise PlanError(f"{where}: replicas are numbered {replicas}; number them 0, 1, ... without gaps")
    if len(replicas) > 1 and len(plan.replica_batch) != len(replicas):
        raise PlanError(f"{where}: {len(replicas)} data-parallel replicas need replica_batch with one example count each")
    if any(b < plan.num_microbatches or b % plan.num_microbatches for b in plan.replica_batch):
        raise PlanError(f"{where}: each replica's examples {list(plan.replica_batch)} must be a positive multiple of num_microbatches")
    for replica in replicas:
        _check_stages(list(plan.replica_stages(replica)), plan, where)
        _check_chunks(list(plan.replica_stages(replica)), plan, where)
    check_parts(plan, where)
    used = [i for s in plan.stages if s.chunk == 0 for i in s.device_ids]
    if len(used) != len(set(used)):
        raise PlanError(f"{where}: two stages share a device; each device belongs to one stage "
                        "(or, under an interleaved schedule, to the chunks of one device group)")
    _check_operator_stages(plan, where)
    for s in plan.stages:
        _check_shardings(s, f"{where}: stage {s.index}")


def check_parts(plan: Plan, where: str = "plan") -> None:
    """Mixed-kind stages (`StagePlan.part_of`): each part names a stage of its own as
    its lead, runs the lead's layers in the lead's replica, and the parts' examples
    make up the microbatch."""
    if not plan.mixed_stages:
        return
    index = {s.index: s for s in plan.stages}
    if [s.index for s in plan.stages] != list(range(len(plan.stages))):
        raise PlanError(f"{where}: stages are numbered {sorted(index)}; number them 0, 1, ... in order")
    for s in plan.stages:
        if not s.is_part:
            continue
        lead = index.get(s.part_of)
        if lead is None or lead.is_part:
            raise PlanError(f"{where}: stage {s.index} is a part of stage {s.part_of}, which is not a stage of its own; "
                            f"part_of names the index of the mixed stage's first part")
        if (s.layer_start, s.layer_end, s.replica, s.chunk, s.remat) != (lead.layer_start, lead.layer_end, lead.replica,
                                                                        lead.chunk, lead.remat):
            raise PlanError(f"{where}: stage {s.index} is a part of stage {lead.index} but differs from it in layers, replica, "
                            f"chunk or recomputation; a mixed stage's parts run the same layers on different rows")
    batch = plan.replica_batch or ((plan.cost_inputs.batch_size,) if plan.cost_inputs else ())
    for lead in plan.mixed_stages:
        parts = plan.parts(lead)
        counts = [s.examples for s in parts]
        size = batch[parts[0].replica] // plan.num_microbatches if batch else None
        if any(c < 1 for c in counts) or (size is not None and sum(counts) != size):
            raise PlanError(f"{where}: the parts of mixed stage {lead} (stages {[s.index for s in parts]}) take {counts} examples "
                            f"of each microbatch" + (f" of {size}" if size is not None else "") + ": give each part at least one"
                            + (f" and make them sum to {size}" if size is not None else ""))


def _check_operator_stages(plan: Plan, where: str) -> None:
    """Every replica places each operator on a stage of the plan. (Work that reads
    step inputs alone may run on another replica's stage: it is the same for all.)
    A plan without them can be shown and simulated; compile refuses it."""
    if not plan.operator_stages:
        return
    if len(plan.operator_stages) != len(replicas := sorted({s.replica for s in plan.stages})):
        raise PlanError(f"{where}: operator_stages must list each of the {len(replicas)} replica(s)' operator placement "
                        f"(found {len(plan.operator_stages)}); solve the plan again")
    for r in replicas:
        for run in plan.operator_stages[r]:
            if len(run) != 2 or not isinstance(run[0], int) or not 0 <= run[0] < len(plan.stages) \
                    or not isinstance(run[1], int) or run[1] < 1:
                raise PlanError(f"{where}: operator_stages[{r}] has the run {list(run)}; each run is [stage, count] with a stage "
                                f"index below {len(plan.stages)} and a positive count")


def _check_shardings(stage: StagePlan, label: str) -> None:
    axes = set(("data", "model", "model2")[: max(1, len(stage.mesh_shape))])  # model2: a 3-axis mesh
    data = (stage.mesh_shape or (stage.num_devices,))[0]
    if not isinstance(stage.zero_group, int) or stage.zero_group < 0 or stage.zero_group and data % stage.zero_group:
        raise PlanError(f"{label}: zero_group is {stage.zero_group!r}, which does not divide the stage's data axis of {data} "
                        f"devices; use a divisor of {data} (the devices of a node) or 0 to shard over all of them")
    if 0 < stage.zero_group < data:
        axes.add("zero")  # hybrid sharding: ZeRO's in-node part of the data axis
    for entry in (*stage.shardings, *stage.gathered):
        if len(entry) != 2 or not isinstance(entry[0], int) or entry[0] < 0 or any(a is not None and a not in axes for a in entry[1]):
            raise PlanError(f"{label}: the sharding {list(entry)} is not [value id, [mesh axis or null per dimension]] "
                            f"over this stage's axes {sorted(axes)}")
    if stage.zero not in (0, 1, 2, 3):
        raise PlanError(f"{label}: zero is {stage.zero!r}; the ZeRO stage is 0 (replicated state), 1, 2 or 3")
    if stage.offload not in OFFLOAD_TIERS:
        raise PlanError(f"{label}: offload is {stage.offload!r}; use one of {', '.join(repr(t) for t in OFFLOAD_TIERS)}")
    if stage.offloaded and not stage.offload:
        raise PlanError(f"{label}: the stage lists values kept off its devices (offloaded) but offload is ''; "
                        "set offload to \"host\" or \"nvme\", or drop offloaded")
    if any(len(pair) != 2 or not all(isinstance(v, int) and v >= 0 for v in pair) for pair in stage.offloaded):
        raise PlanError(f"{label}: offloaded lists [state value id, new state value id] pairs of non-negative integers")
    for c in stage.model_collectives:
        if len(stage.mesh_shape) != 3 or len(c) != 7 or not stage.layer_start <= c[0] < stage.layer_end:
            raise PlanError(f"{label}: model_collectives lists {list(c)}; they are [layer, backward, collective, devices, bytes, "
                            f"bytes per example, count] for the layers {stage.layer_start}..{stage.layer_end - 1} of a stage on "
                            f"a 3-axis mesh (this one's is {list(stage.mesh_shape)}): solve the plan again")
    if stage.gathered and stage.zero != 3:
        raise PlanError(f"{label}: the stage lists parameters to gather (gathered) but zero is {stage.zero}; only ZeRO-3 "
                        f"stores parameters sharded: set zero to 3 or drop gathered")


def _check_chunks(stages: list[StagePlan], plan: Plan, where: str) -> None:
    """Stages may share devices only as chunks of one device group under an
    interleaved schedule: stage p of D x v is chunk p // D on group p mod D's devices."""
    schedule = schedules.get(plan.schedule)
    v = plan.chunks
    if not schedule.interleaved:
        if v > 1:
            raise PlanError(f"{where}: stages have chunk numbers up to {v - 1}, but schedule {plan.schedule!r} runs one chunk "
                            f"per device group; use an interleaved schedule or set every chunk to 0")
        return
    if len(stages) % v:
        raise PlanError(f"{where}: {len(stages)} stages do not split into {v} chunks per device group")
    d = len(stages) // v
    for p, s in enumerate(stages):
        home = stages[p % d]
        if s.chunk != p // d or s.device_ids != home.device_ids:
            raise PlanError(f"{where}: stage {s.index} is chunk {s.chunk} on devices {list(s.device_ids)}; under "
                            f"{plan.schedule!r} with {v} chunks over {d} device groups, stage {s.index} must be chunk {p // d} "
                            f"on the devices of stage {home.index} ({list(home.device_ids)})")
    why = schedule.check(d, plan.num_microbatches, v)
    if why:
        raise PlanError(f"{where}: {why}")


def _check_stages(stages: list[StagePlan], plan: Plan, where: str) -> None:
    """One pipeline's stages: known devices, layers covered in order, sane degrees."""
    expected_start = 0
    for s in stages:
        label = f"{where}: stage {s.index}"
        _known_type(s.device_type, label)
        if not s.device_ids:
            raise PlanError(f"{label} has no devices")
        if min(s.device_ids) < 0:
            raise PlanError(f"{label} names a negative device position {min(s.device_ids)}")
        if s.layer_start != expected_start or s.layer_end <= s.layer_start:
            raise PlanError(
                f"{label} covers layers {s.layer_start}..{s.layer_end - 1}; stages must cover the layers in order "
                f"without gaps, and this one should start at layer {expected_start}"
            )
        expected_start = s.layer_end
        if s.tensor_parallel < 1 or s.data_parallel < 0 or not 0 < s.batch_share <= 1:
            raise PlanError(f"{label}: tensor_parallel, data_parallel and batch_share must be positive (batch_share at most 1)")
    if expected_start != plan.num_layers:
        raise PlanError(f"{where}: the stages cover {expected_start} layers but the plan says the model has {plan.num_layers}")


def _known_type(name: str, label: str) -> None:
    try:
        device_type(name)
    except ClusterError as e:
        raise PlanError(f"{label}: {e}") from None


def _list(raw: dict, key: str, where: str) -> list:
    value = raw.get(key)
    if not isinstance(value, list):
        raise PlanError(f"{where}: {key!r} must be a list")
    return value


def _build(cls: type, raw: Any, label: str) -> Any:
    """A dataclass from a JSON object: missing and unknown fields are named; lists
    become tuples (the dataclasses are frozen, their sequences tuples)."""
    if not isinstance(raw, dict):
        raise PlanError(f"{label} must be a JSON object")
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise PlanError(f"{label} has unknown field(s) {', '.join(unknown)}")
    required = [n for n, f in names.items() if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in raw]
    if missing:
        raise PlanError(f"{label} lacks {', '.join(missing)}")
    return cls(**{k: _tuples(v) for k, v in raw.items()})


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value

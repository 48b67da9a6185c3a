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
from hetpar.plan import ClusterGroup, Plan, ProgramSignature, StagePlan
from hetpar.plan_schema import check_plan_json

PLAN_VERSION = 1
SCHEDULES = ("gpipe", "1f1b")


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data (lists, not tuples)."""
    return json.loads(json.dumps({"version": PLAN_VERSION, **asdict(plan)}))


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(plan_to_dict(plan), indent=1) + "\n")


def load_plan(path: str | Path) -> Plan:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PlanError(f"cannot read plan {path}: {e.strerror}") from None
    check_plan_json(data, str(path))  # every field's type and range (plan_schema.py)
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
    top = {k: v for k, v in raw.items() if k not in ("version", "stages", "cluster_groups", "program")}
    plan = _build(Plan, {**top, "stages": stages, "cluster_groups": groups, "program": program}, where)
    try:
        check_plan(plan, where)
    except TypeError:
        raise PlanError(f"{where}: a field has the wrong type (numbers must be numbers, lists lists)") from None
    return plan


def check_plan(plan: Plan, where: str = "plan") -> None:
    """Refuses a plan that cannot run: every figure a hand edit could break."""
    if not plan.stages:
        raise PlanError(f"{where}: the plan has no stages")
    if plan.num_microbatches < 1:
        raise PlanError(f"{where}: num_microbatches must be at least 1, got {plan.num_microbatches}")
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"{where}: unknown schedule {plan.schedule!r}; use one of {', '.join(SCHEDULES)}")
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
        _check_stages([s for s in plan.stages if s.replica == replica], plan, where)
    used = [i for s in plan.stages for i in s.device_ids]
    if len(used) != len(set(used)):
        raise PlanError(f"{where}: two stages share a device; each device belongs to one stage")


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

"""The plan file's schema: every field of the current JSON format (file.py,
version 2) with its type and range, checked before any of it is used.

It mirrors hetpar.plan's dataclasses field for field; tests/test_validation.py
checks that they agree, so a field added to the Plan fails that test until it is
added here too. Unknown fields are refused (`extra="forbid"`): a plan from a newer
hetpar, or a typo in a hand edit, is named rather than silently dropped. To accept a
new field, add it to the model below with its type and range; to read an older
format, bump PLAN_VERSION below and convert in file.py.

Checks that span fields (stage indices in order, device positions inside the
cluster, mesh shapes that multiply to the stage's devices) are here too; checks
that need the device catalog or the layer cover stay in file.check_plan.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetpar.errors import PlanError
from hetpar.validation import one_line
from solver import schedules

# 2: operator stages and structured shardings, so compile needs nothing but the plan.
# 3: cost inputs (the estimator's Problem); predicted figures are a cache, priced again on load.
PLAN_VERSION = 3

# Far beyond any real plan, small enough that nothing downstream runs out of memory.
MAX_DEVICES = 1 << 20
MAX_COUNT = 1 << 40

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Positive = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Seconds = Annotated[float, Field(ge=0)]
Figure = Annotated[float, Field(ge=0)]  # FLOPs, FLOP/s
DevicePosition = Annotated[int, Field(ge=0, lt=MAX_DEVICES)]
Name = Annotated[str, Field(max_length=10_000)]
Axis = Annotated[str, Field(max_length=100)]
Spec = Annotated[tuple[Axis | None, ...], Field(max_length=64)]  # a PartitionSpec: mesh axis or null per dimension


class _Strict(BaseModel):
    # strict: 4.0 is not a count and "4" not a number; JSON lists stand for tuples.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)




class StageSchema(_Strict):
    index: Count
    device_type: Name
    device_ids: Annotated[tuple[DevicePosition, ...], Field(min_length=1, max_length=MAX_DEVICES)]
    layer_start: Count
    layer_end: Positive
    layer_names: Name
    flops: Figure
    speed_flops: Figure
    predicted_time_s: Seconds
    group: Name = ""
    mesh_shape: Annotated[tuple[Positive, ...], Field(max_length=3)] = ()  # data, model (, model2: 3D tensor parallelism)
    data_parallel: Count = 0
    tensor_parallel: Positive = 1
    batch_share: Annotated[float, Field(gt=0, le=1)] = 1.0
    forward_s: Seconds = 0.0
    backward_s: Seconds = 0.0
    send_s: Seconds = 0.0
    sync_s: Seconds = 0.0
    optimizer_s: Seconds = 0.0
    memory_bytes: Count = 0
    memory_capacity: Count = 0
    param_specs: tuple[tuple[Name, Spec], ...] = ()  # (parameter path, PartitionSpec)
    replica: Count = 0
    shardings: tuple[tuple[Count, Spec], ...] = ()  # (value id, PartitionSpec)
    operand_shardings: tuple[tuple[Count, tuple[Spec, Spec]], ...] = ()  # (operator index, (lhs, rhs))
    chunk: Count = 0
    zero: Annotated[int, Field(ge=0, le=3)] = 0  # ZeRO stage over the data axis
    zero_group: Count = 0  # hybrid sharding: devices of the data axis ZeRO shards over (0: all)
    gathered: tuple[tuple[Count, Spec], ...] = ()  # ZeRO-3: (value id, PartitionSpec while in use)
    remat: Literal["", "full", "dots"] = ""
    offload: Literal["", "host", "nvme"] = ""  # where the optimizer state lives between steps
    offloaded: tuple[tuple[Count, Count], ...] = ()  # (state value id read, new state value id returned)
    host_bytes: Count = 0
    nvme_bytes: Count = 0
    # 3-axis mesh: (layer, backward, collective, devices, bytes per device, bytes per example, count)
    model_collectives: tuple[tuple[Count, bool, Literal["all_reduce", "all_gather"], Positive, Figure, Figure, Positive], ...] = ()
    part_of: Annotated[int, Field(ge=-1)] = -1  # a mixed-kind stage's part: its lead's index (-1: a stage of its own)
    examples: Count = 0  # a mixed-kind stage's part: rows of each microbatch it takes (0: all)

    @model_validator(mode="after")
    def _shape(self) -> "StageSchema":
        if self.layer_end <= self.layer_start:
            raise ValueError(f"layer_end {self.layer_end} must be after layer_start {self.layer_start}")
        if self.mesh_shape and math.prod(self.mesh_shape) != len(self.device_ids):
            raise ValueError(
                f"mesh_shape {list(self.mesh_shape)} holds {math.prod(self.mesh_shape)} devices but the stage has "
                f"{len(self.device_ids)}; the mesh's sides must multiply to the stage's devices"
            )
        data = (self.mesh_shape or (len(self.device_ids),))[0]
        if self.zero_group and data % self.zero_group:
            raise ValueError(f"zero_group {self.zero_group} does not divide the stage's data axis of {data} devices; "
                             f"use a divisor of {data} (the devices of a node), or 0 to shard over all of them")
        if len(set(self.device_ids)) != len(self.device_ids):
            raise ValueError("device_ids names a device twice")
        if self.offloaded and not self.offload:
            raise ValueError("the stage lists values kept off its devices (offloaded) but offload is ''; "
                             "set offload to \"host\" or \"nvme\", or drop offloaded")
        return self


class ClusterGroupSchema(_Strict):
    name: Name
    device_type: Name
    devices: Annotated[int, Field(ge=1, le=MAX_DEVICES)]


class ProgramSchema(_Strict):
    inputs: tuple[Name, ...]
    outputs: tuple[Name, ...]
    num_operators: Count
    digest: Name


class PlanSchema(_Strict):
    version: Literal[PLAN_VERSION]
    stages: Annotated[tuple[StageSchema, ...], Field(min_length=1, max_length=MAX_DEVICES)]
    num_microbatches: Positive
    num_layers: Positive
    cluster: Name
    schedule: Name = schedules.DEFAULT
    notes: tuple[Name, ...] = ()
    cluster_groups: tuple[ClusterGroupSchema, ...] = ()
    program: ProgramSchema | None = None
    tokens_per_step: Count = 0
    model_flops: Figure = 0.0
    peak_flops: Figure = 0.0
    bound_ratio: Annotated[float, Field(ge=0)] | None = None
    replica_batch: tuple[Positive, ...] = ()
    operator_stages: tuple[tuple[tuple[Count, Positive], ...], ...] = ()  # per replica: (stage, operators) runs
    predicted_step_time_s: Figure = 0.0  # a cache of the estimator's price; never read back
    # The estimator's inputs (solver.planner.Problem as JSON): checked field by field
    # against the dataclasses by hetpar.plan.file when the plan is built.
    cost_inputs: dict[str, Any] | None = None
    estimator_version: Count = 0  # the estimator that made the cached figures

    @model_validator(mode="after")
    def _stages(self) -> "PlanSchema":
        if self.schedule not in schedules.names():
            raise ValueError(f"unknown schedule {self.schedule!r}; use one of {', '.join(schedules.names())}")
        for position, stage in enumerate(self.stages):
            if stage.index != position:
                raise ValueError(f"stages[{position}].index is {stage.index}; stages are numbered 0, 1, ... in order")
        if self.cluster_groups:
            total = sum(g.devices for g in self.cluster_groups)
            for stage in self.stages:
                if max(stage.device_ids) >= total:
                    raise ValueError(
                        f"stages[{stage.index}].device_ids names device position {max(stage.device_ids)} but the "
                        f"cluster_groups hold {total} devices (positions 0..{total - 1})"
                    )
        return self


def check_plan_json(text: str | bytes, where: str) -> None:
    """Refuses a plan file's text that does not match the schema, with one line that
    names the field. JSON syntax errors and absurd nesting are refused here too."""
    try:
        PlanSchema.model_validate_json(text)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise PlanError(f"{where} is not valid JSON ({first['msg']}); was the file cut short or edited by hand? Solve the plan again with hetpar solve") from None
        if first["loc"] == ("version",):
            raise PlanError(
                f"{where} has plan format version {first.get('input')!r}; this hetpar reads version {PLAN_VERSION}: solve the plan again"
            ) from None
        raise PlanError(f"{where}: {one_line(e, 'fix that field, or solve the plan again with hetpar solve')}") from None

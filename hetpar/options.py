"""The settings of each pass, as typed option objects (Alpa's style).

`parallelize` and `hetpar solve` build one of each from their keyword arguments and
hand each pass its own; every tuning value a user may want to change lives here,
not as a module constant. The objects are frozen: a pass cannot change another's.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, replace
from typing import Any

import pydantic

from hetpar.errors import HetparError, PlanError
from solver import schedules
from solver.memory import OFFLOAD_TIERS, REMAT_POLICIES

STAGE_MODES = ("auto", "manual", "uniform")
RUNTIMES = ("local", "distributed", "ray")


@dataclass(frozen=True)
class StageOption:
    """How the step's layers become pipeline stages.

    - "auto": the planner chooses stages, their devices, the layer split, replicas,
      microbatches and (without `schedule`) the schedule.
    - "manual": `num_stages` stages (or `num_replicas` pipelines of them), one device
      group each, layers split in proportion to each stage's speed.
    - "uniform": like "manual", but every stage takes the same number of layers
      (Megatron's split), the baseline a heterogeneous split is compared with.

    A stage or replica count fixes the pipeline: with the default mode "auto" it
    means "manual".
    """

    mode: str = "auto"
    num_stages: int | None = None
    num_replicas: int | None = None
    num_layers: int | None = None  # None: enough for the stages, cut at module boundaries
    schedule: str | None = None  # None: the planner's choice ("auto"), GPipe otherwise
    # Stages per device group under an interleaved schedule (Megatron's virtual stages):
    # "manual"/"uniform" put `chunks` non-adjacent stages on each of `num_stages` groups;
    # "auto" lets the planner try this count (None: its default choices).
    chunks: int | None = None
    time_limit_s: float | None = None  # the planner's search; None: until proven optimal
    # The search's best plans by its closed form that the estimator ranks ("auto"; None:
    # solver.planner.search.FINALISTS). More where the closed form may misjudge a plan the
    # estimator would prefer; each one more makes the search prove more.
    finalists: int | None = None
    max_planning_layers: int = 8  # "auto" cuts the step into at most this many layers
    layer_overhead_s: float = 50e-6  # kernel launches of one layer's forward and backward
    # Recomputation on every stage: "" none, "full" (nothing kept, the backward reruns
    # the forward), "dots" (matmul results without batch dims kept). None: the
    # planner ("auto") recomputes where memory needs it; hand-made plans do not.
    remat: str | None = None
    # "auto": only plans that give every device kind work. Without it the planner may
    # leave a kind idle, and the plan's notes say what using it would cost.
    use_all_kinds: bool = False
    # A `hetpar profile` file: its measured figures price the device kinds it has, in
    # place of the catalog's (any mode: every plan is priced by the same estimator).
    profile: str | None = None
    # Where each stage keeps its optimizer state between steps: "host" in host memory on
    # every stage (JAX's pinned_host memory kind, moved to the devices for the update),
    # "nvme" in a file store on the node's disk (RuntimeOption.nvme_dir, read and written
    # around the update), "" on the devices. None: the planner ("auto") offloads a stage
    # only where it fits no other way, to disk only where host memory is short; hand-made
    # plans do not.
    offload: str | None = None


@dataclass(frozen=True)
class ShardingOption:
    """How each stage's operators are sharded over its devices (the intra-op ILP)."""

    mesh_shape: tuple | None = None  # (data, model), or one per stage; None: the ILP picks each stage's split
    time_limit_s: float = 5.0  # per stage solve, in CP-SAT deterministic seconds (load-proof; solver/cpsat.py); past it the best found is used, its gap logged
    # The ILP prices matmuls and their collectives; the elementwise work between them,
    # which it does not see, is repeated on every device of a model axis, so a model
    # axis must win by this fraction to be chosen.
    model_axis_margin: float = 0.10
    # ZeRO over each stage's `data` axis (see StagePlan.zero): None lets the sharding
    # pass choose per parameter, replication unless the stage's state would not fit
    # its devices' memory (Alpa's force_zero_stage_3 is zero=3); 0-3 forces that
    # stage on every stage.
    zero: int | None = None
    # Hybrid sharding (HSDP, see StagePlan.zero_group): ZeRO over groups of this many
    # consecutive devices of each stage's data axis (a node's), replicated across the
    # groups, so only one group-shard's gradient all-reduce crosses nodes. Must divide
    # every ZeRO stage's data axis; None or 0: over the whole data axis. "auto": the
    # sharding pass takes a node's data ranks for a stage whose ZeRO stage is known and
    # whose data axis spans nodes, where the estimator prices that faster (or only it fits).
    zero_group: int | str | None = None
    # 3D tensor parallelism (hetpar.shard.model_axes): a stage's model axis of 4 or more
    # devices may be laid out as two, `model` x `model2`, where the ILP prices that
    # cheaper. None: where the sharding pass chooses the meshes (no mesh_shape given);
    # True: a (data, model) mesh_shape given by hand too; False: never.
    factor_model_axis: bool | None = None


@dataclass(frozen=True)
class RuntimeOption:
    """Where and how the compiled stages run."""

    # "local": this process; "distributed": every process of a jax.distributed job runs
    # the step on its own devices (chosen by itself when the job has several processes);
    # "ray": one Ray actor per device group (its stages and chunks), state through the driver
    runtime: str = "local"
    # The Ray runtime's wait for a step or a build before it reports a stuck worker;
    # None: the HETPAR_WORKER_TIMEOUT_S environment variable, or 300 s.
    timeout_s: float | None = None
    # The folder of the NVMe tier's file store (stages with offload="nvme" keep their
    # optimizer state there between steps: hetpar/runtime/nvme_store.py); a local NVMe
    # disk's. None: a fresh folder under the system's temporary directory.
    nvme_dir: str | None = None


def check_options(stage: StageOption, sharding: ShardingOption, runtime: RuntimeOption) -> None:
    """Refuses settings no pass could honour, naming the field and what it takes."""
    for option in (stage, sharding, runtime):
        _check_types(option)
    if sharding.mesh_shape is not None:
        shapes = sharding.mesh_shape if isinstance(sharding.mesh_shape[0], tuple) else (sharding.mesh_shape,)
        for shape in shapes:
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
                raise PlanError(f"ShardingOption.mesh_shape {sharding.mesh_shape!r}: each mesh is (data, model) with "
                                "positive whole numbers, e.g. (2, 4), or (data, model, model2) for 3D tensor "
                                "parallelism, or one such shape per stage")
    if not stage.layer_overhead_s >= 0:
        raise PlanError(f"StageOption.layer_overhead_s is seconds per layer, at least 0, got {stage.layer_overhead_s}")
    if stage.mode not in STAGE_MODES:
        raise PlanError(f"StageOption.mode {stage.mode!r} is not one of {', '.join(STAGE_MODES)}")
    for name in ("num_stages", "num_replicas", "num_layers", "finalists"):
        value = getattr(stage, name)
        if value is not None and value < 1:
            raise PlanError(f"{name} must be at least 1, got {value}")
    if stage.schedule is not None and stage.schedule not in schedules.names():
        raise PlanError(f"unknown schedule {stage.schedule!r}; use one of {', '.join(schedules.names())}")
    if stage.chunks is not None and stage.chunks < 1:
        raise PlanError(f"StageOption.chunks must be at least 1, got {stage.chunks}")
    if (stage.chunks or 1) > 1 and stage.schedule is not None and not schedules.get(stage.schedule).interleaved:
        interleaved = [n for n in schedules.names() if schedules.get(n).interleaved]
        raise PlanError(f"StageOption.chunks={stage.chunks} puts several stages on each device group, which only an "
                        f"interleaved schedule runs: use schedule={interleaved[0]!r}, or drop chunks")
    if stage.time_limit_s is not None and not stage.time_limit_s > 0:
        raise PlanError(f"StageOption.time_limit_s must be positive (or None for no limit), got {stage.time_limit_s}")
    if stage.remat is not None and stage.remat not in REMAT_POLICIES:
        raise PlanError(f"StageOption.remat {stage.remat!r} is not a recomputation policy; use one of "
                        f"{', '.join(repr(p) for p in REMAT_POLICIES)} (or None: the planner's choice)")
    if stage.offload is not None and stage.offload not in OFFLOAD_TIERS:
        raise PlanError(f"StageOption.offload {stage.offload!r} is not a place for optimizer state; use 'host' (host memory), "
                        "'nvme' (a file store on a local disk), '' (the devices) or None (the planner's choice)")
    if stage.max_planning_layers < 1:
        raise PlanError(f"StageOption.max_planning_layers must be at least 1, got {stage.max_planning_layers}")
    if not sharding.time_limit_s > 0:
        raise PlanError(f"ShardingOption.time_limit_s must be positive, got {sharding.time_limit_s}")
    if sharding.zero is not None and sharding.zero not in (0, 1, 2, 3):
        raise PlanError(f"ShardingOption.zero is the ZeRO stage 0, 1, 2 or 3 (or None: chosen per parameter), got {sharding.zero!r}")
    if sharding.zero_group not in (None, "auto") and (isinstance(sharding.zero_group, bool)
                                                      or not isinstance(sharding.zero_group, int) or sharding.zero_group < 0):
        raise PlanError(f"ShardingOption.zero_group is how many devices of a stage's data axis ZeRO shards over (a node's), "
                        f"a whole number at least 0 (0 or None: all of them), or \"auto\", got {sharding.zero_group!r}")
    if not 0 <= sharding.model_axis_margin < 1:
        raise PlanError(f"ShardingOption.model_axis_margin is a fraction in [0, 1), got {sharding.model_axis_margin}")
    if runtime.runtime not in RUNTIMES:
        raise HetparError(f"unknown runtime {runtime.runtime!r}; use 'local' (this process) or 'ray' (one process per mesh)")
    if runtime.timeout_s is not None and not runtime.timeout_s > 0:
        raise HetparError(f"RuntimeOption.timeout_s must be positive, got {runtime.timeout_s}")


def build_options(
    stage_option: StageOption | None = None,
    sharding_option: ShardingOption | None = None,
    runtime_option: RuntimeOption | None = None,
    *,
    num_stages: int | None = None,
    num_replicas: int | None = None,
    num_layers: int | None = None,
    schedule: str | None = None,
    chunks: int | None = None,
    mesh_shape: tuple | None = None,
    runtime: str | None = None,
    use_all_kinds: bool | None = None,
    profile: str | None = None,
    offload: str | None = None,
) -> tuple[StageOption, ShardingOption, RuntimeOption]:
    """The option objects, with the keyword shortcuts `parallelize` and `make_plan`
    take folded in (a stage or replica count fixes the pipeline: mode "manual"), and
    checked."""
    if mesh_shape and isinstance(mesh_shape[0], tuple | list):
        mesh_shape = tuple(tuple(shape) for shape in mesh_shape)
    stage = _with(stage_option or StageOption(), "stage_option",
                  num_stages=num_stages, num_replicas=num_replicas, num_layers=num_layers, schedule=schedule, chunks=chunks,
                  use_all_kinds=use_all_kinds or None, profile=profile, offload=offload)
    if stage.mode == "auto" and (stage.num_stages or stage.num_replicas):
        stage = replace(stage, mode="manual")
    sharding = _with(sharding_option or ShardingOption(), "sharding_option", mesh_shape=tuple(mesh_shape) if mesh_shape else None)
    runtime_opt = _with(runtime_option or RuntimeOption(), "runtime_option", runtime=runtime)
    check_options(stage, sharding, runtime_opt)
    return stage, sharding, runtime_opt


def _with(option: Any, name: str, **shortcuts: Any) -> Any:
    """`option` with the shortcut keywords that were given; a shortcut that disagrees
    with a field set in the option object given beside it is an error, not a silent
    choice."""
    given = {k: v for k, v in shortcuts.items() if v is not None}
    default = type(option)()
    for key, value in given.items():
        current = getattr(option, key)
        if current != getattr(default, key) and current != value:
            raise HetparError(f"{key}={value!r} disagrees with {name}.{key}={current!r}; give it once")
    return replace(option, **given) if given else option


@functools.cache
def _schema(kind: type) -> type[pydantic.BaseModel]:
    """The option class's fields as a strict pydantic model: "2" for a count or 2.0
    for a ZeRO stage is a mistake to name, not to coerce (a coerced 2.0 would be
    saved into a plan file that cannot load it), and NaN is never a setting."""
    hints = typing.get_type_hints(kind)
    fields = {f.name: (hints[f.name], ...) for f in dataclasses.fields(kind)}
    return pydantic.create_model(kind.__name__, __config__=pydantic.ConfigDict(strict=True, allow_inf_nan=False),
                                 **fields)


def _check_types(option: Any) -> None:
    """Each field's type, from the dataclass's own annotations, in one line."""
    values = {f.name: getattr(option, f.name) for f in dataclasses.fields(option)}
    if isinstance(values.get("mesh_shape"), list):
        values["mesh_shape"] = tuple(values["mesh_shape"])
    try:
        _schema(type(option)).model_validate(values)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        field = ".".join(str(part) for part in error["loc"][:1])
        value = values.get(field, error.get("input"))
        expected = error["msg"].removeprefix("Input should be ").rstrip(".")
        raise PlanError(f"{type(option).__name__}.{field} must be {expected}, got {value!r} "
                        f"({type(value).__name__})") from None

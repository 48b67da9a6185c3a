"""Plan: where every part of the step runs. Plain data: printable for people, saved as
JSON (see file.py), and checked against the program it was made for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from hetpar.trace.fingerprint import ProgramSignature
from solver.schedules import DEFAULT, StageTimes

if TYPE_CHECKING:  # the type only: compile and the runtime read plans without importing the planner
    from solver.cost.problem import Problem

# A PartitionSpec as plain data: the mesh axis (or None) of each dimension.
Spec = tuple[Optional[str], ...]


@dataclass(frozen=True)
class StagePlan:
    index: int
    device_type: str
    device_ids: tuple[int, ...]  # positions in the cluster's device order
    layer_start: int
    layer_end: int  # exclusive
    layer_names: str
    flops: float  # forward + backward, full batch
    speed_flops: float  # the stage's peak FLOP/s (devices x per-device peak)
    predicted_time_s: float  # forward + backward of the full batch on this stage
    group: str = ""  # the cluster group its devices come from
    mesh_shape: tuple[int, ...] = ()
    data_parallel: int = 0  # 0: all the stage's devices
    tensor_parallel: int = 1
    batch_share: float = 1.0  # fraction of the global batch this stage's pipeline takes
    forward_s: float = 0.0  # per microbatch, predicted
    backward_s: float = 0.0  # per microbatch, predicted
    send_s: float = 0.0  # one microbatch's activation to the next stage
    sync_s: float = 0.0  # gradient all-reduce across the stage's data-parallel devices
    optimizer_s: float = 0.0
    memory_bytes: int = 0  # predicted peak per device
    memory_capacity: int = 0  # per device
    param_specs: tuple[tuple[str, Spec], ...] = ()  # (parameter path, mesh axis per dimension), for people and checks
    replica: int = 0  # which data-parallel pipeline this stage belongs to
    # The stage's intra-op sharding, as compile applies it: (value id in the traced
    # program, mesh axis per dimension) for every weight and matmul result it fixes.
    shardings: tuple[tuple[int, Spec], ...] = ()
    # Each matmul's two operands, pinned to the layouts its strategy was priced with
    # (operator index, (lhs, rhs)): see hetpar.compile.programs.compile_task.
    operand_shardings: tuple[tuple[int, tuple[Spec, Spec]], ...] = ()
    # Which of its device group's chunks this stage is (interleaved schedules): stages
    # with the same device_ids are chunks of one group and share its mesh.
    chunk: int = 0
    # ZeRO over the stage's `data` mesh axis (DeepSpeed's stages): 0 every data-parallel
    # device holds the whole state; 1 optimizer state sharded; 2 gradients too
    # (reduce-scattered, not all-reduced); 3 parameters too, all-gathered where the
    # forward and backward read them. The highest level any parameter of the stage got:
    # the layouts themselves are in `shardings` (a parameter left whole has no data axis).
    zero: int = 0
    # Hybrid sharding (HSDP): how many of the data axis's devices ZeRO shards over,
    # a divisor of the data axis, consecutive devices (those of a node); 0 (or the whole
    # axis): all of them. Below the data axis, the mesh splits it into `replica` (across
    # nodes) x `zero` (within a node): parameters and optimizer state shard over `zero`
    # only (the layouts name it), examples over both, and only one node-shard's gradient
    # all-reduce crosses nodes, as FSDP's hybrid shard and MaxText's in-node axis do.
    zero_group: int = 0
    # ZeRO-3: each data-sharded parameter's layout while in use (value id, layout): the
    # stage's forward and backward programs gather it to this where they read it.
    gathered: tuple[tuple[int, Spec], ...] = ()
    # Recomputation (REMAT_POLICIES): "" keeps every forward activation for the
    # backward; "full" keeps none (the backward program reruns the stage's forward from
    # its inputs); "dots" keeps matmul results without batch dimensions, as
    # jax.checkpoint_policies.dots_with_no_batch_dims_saveable does.
    remat: str = ""
    # Where the stage keeps its optimizer state between steps (solver.memory.OFFLOAD_TIERS):
    # "" on its devices; "host" in host memory (JAX's pinned_host memory kind), moved to the
    # devices for the update and the new state back; "nvme" in a file store on the node's
    # disk between steps (hetpar/runtime/nvme_store.py), read through host memory for the
    # update and the new state written back. `offloaded` lists the values so kept:
    # (value id of the state the step reads, value id of the new state it returns).
    offload: str = ""
    offloaded: tuple[tuple[int, int], ...] = ()
    host_bytes: int = 0  # predicted host memory per device (offloaded state), all chunks of its device group
    nvme_bytes: int = 0  # predicted local-disk bytes per device (NVMe-tier state), all chunks of its device group
    # A stage whose tensor parallelism spans two model axes (a 3-axis mesh): the collectives
    # its layouts run per microbatch, as the sharding pass's solver chose them, which the
    # estimator prices in place of Megatron's (solver.cost.model_axes.ModelCollective):
    # (layer, in the backward, collective, devices, bytes per device, bytes per example, count).
    model_collectives: tuple[tuple[int, bool, str, int, float, float, int], ...] = ()
    # A mixed-kind stage (Metis's and HETHUB's split, Whale's): one pipeline position whose
    # data-parallel parts sit on meshes of different kinds, each taking `examples` rows of
    # every microbatch (in proportion to its speed, whole examples), their gradients
    # summed as replicas' are. The position's first part is the stage `operator_stages`
    # names (its lead, `part_of` -1); every other part is a StagePlan of its own with
    # `part_of` the lead's index, the lead's layers, replica, chunk and recomputation.
    # Rows go to the parts in index order: the lead's first. `examples` 0: not mixed.
    part_of: int = -1
    examples: int = 0

    @property
    def is_part(self) -> bool:
        """A part of a mixed stage other than its lead (no pipeline position of its own)."""
        return self.part_of >= 0

    @property
    def lead(self) -> int:
        """The stage whose operators this one runs and whose position it holds: a mixed
        stage's part's lead (`Plan.operator_stages` names the lead), else itself."""
        return self.part_of if self.is_part else self.index

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    @property
    def times(self) -> StageTimes:
        return StageTimes(self.forward_s, self.backward_s, self.send_s, self.sync_s, self.optimizer_s)


@dataclass(frozen=True)
class ClusterGroup:
    name: str
    device_type: str
    devices: int


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    num_microbatches: int
    num_layers: int
    cluster: str  # for people: "4xA100 + 4xV100"
    schedule: str = DEFAULT
    notes: tuple[str, ...] = field(default=())
    cluster_groups: tuple[ClusterGroup, ...] = ()
    program: ProgramSignature | None = None
    tokens_per_step: int = 0
    model_flops: float = 0.0  # forward + backward per step, without rematerialization
    peak_flops: float = 0.0  # of the devices the plan uses
    bound_ratio: float | None = None  # throughput over the cluster's upper bound, when known
    # Examples each data-parallel pipeline takes per step, when there are several: a
    # pipeline of faster devices takes more (a non-uniform batch split).
    replica_batch: tuple[int, ...] = ()
    # Which stage runs each operator of the traced program, per replica: runs of
    # (stage, number of consecutive operators). Compile reads this and nothing else
    # to cut the step, so a saved plan runs exactly as it was solved.
    operator_stages: tuple[tuple[tuple[int, int], ...], ...] = ()
    # The step as the estimator prices it (hetpar.plan.costs.priced, like every figure
    # above marked predicted): a cache of `cost_inputs` and the decisions, never read
    # from a file; 0 for a plan without cost inputs.
    predicted_step_time_s: float = 0.0
    # What the estimator prices the plan with: the traced step's layers per example and
    # the cluster's device kinds and links, as the planner's Problem. Inputs, not
    # predictions: a loaded plan is priced again from them.
    cost_inputs: Problem | None = None

    def stage_of_operators(self, replica: int) -> list[int]:
        """The stage of every operator of replica `replica`'s pipeline."""
        return [stage for stage, count in self.operator_stages[replica] for _ in range(count)]

    def idle_groups(self) -> tuple[ClusterGroup, ...]:
        """The cluster's device groups no stage runs on."""
        used = {s.group for s in self.stages}
        return tuple(g for g in self.cluster_groups if g.name not in used)

    def describe_devices(self) -> str:
        """The cluster, with the groups the plan leaves idle named as such."""
        idle = self.idle_groups()
        return self.cluster + (f" (idle: {' + '.join(f'{g.devices}x{g.device_type}' for g in idle)})" if idle else "")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_replicas(self) -> int:
        return max(s.replica for s in self.stages) + 1

    def replica_stages(self, replica: int) -> tuple[StagePlan, ...]:
        """Replica `replica`'s pipeline positions in order: a mixed stage by its lead."""
        return tuple(s for s in self.stages if s.replica == replica and not s.is_part)

    def parts(self, stage: int) -> tuple[StagePlan, ...]:
        """The parts of stage `stage` (a lead) in row order, lead first; () when it is not mixed."""
        mine = tuple(s for s in self.stages if s.part_of == stage)
        return (*(s for s in self.stages if s.index == stage), *mine) if mine else ()

    @property
    def mixed_stages(self) -> tuple[int, ...]:
        """The leads of the plan's mixed-kind stages."""
        return tuple(sorted({s.part_of for s in self.stages if s.is_part}))

    def stage_label(self, stage: StagePlan) -> str:
        """How views name a stage: its index, and for a mixed stage's part which part of which stage."""
        lead = stage.lead
        parts = self.parts(lead)
        if not parts:
            return str(stage.index)
        return f"{stage.index} (stage {lead} part {[q.index for q in parts].index(stage.index)})"

    def rows_label(self, stage: StagePlan) -> str:
        """A mixed stage's part's rows of each microbatch, as views print them; "" otherwise."""
        parts = self.parts(stage.lead)
        return f"{stage.examples}/{sum(q.examples for q in parts)} rows" if parts else ""

    @property
    def chunks(self) -> int:
        """Stages per device group: 1, or more under an interleaved schedule."""
        return max(s.chunk for s in self.stages) + 1 if self.stages else 1

    @property
    def has_timings(self) -> bool:
        return any(s.forward_s or s.backward_s for s in self.stages)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.predicted_step_time_s if self.tokens_per_step and self.predicted_step_time_s else 0.0

    @property
    def mfu(self) -> float:
        """PaLM's model FLOPs utilization, predicted."""
        if not (self.peak_flops and self.predicted_step_time_s):
            return 0.0
        return self.model_flops / self.predicted_step_time_s / self.peak_flops

    def __str__(self) -> str:
        lines = [
            f"hetpar plan: {self.num_stages} stage(s) on {self.describe_devices()}, {self.num_layers} layers, "
            f"{self.num_microbatches} microbatch(es), {self.schedule}"
            + (f" ({self.chunks} chunks per device group: stage i on the devices of stage i mod {len(self.replica_stages(0)) // self.chunks})"
               if self.chunks > 1 else ""),
            f"  {'stage':>5}  {'device':<8} {'devices':>7} {'TFLOP/s':>8}  {'layers':<10} {'GFLOP':>9} {'time/step':>11}  modules",
        ]
        for s in self.stages:
            lines.append(
                f"  {self.stage_label(s):>5}  {s.device_type:<8} {s.num_devices:>7} {s.speed_flops / 1e12:>8.1f}  "
                f"{f'{s.layer_start}-{s.layer_end - 1} ({s.num_layers})':<10} {s.flops / 1e9:>9.3f} "
                f"{fmt_time(s.predicted_time_s):>11}  {s.layer_names}"
            )
        for lead in self.mixed_stages:
            lines.append(f"  stage {lead} is mixed: " + ", ".join(
                f"{q.num_devices}x{q.device_type} take {self.rows_label(q).replace(' rows', '')} rows" for q in self.parts(lead))
                + " of each microbatch; its time is its slowest part's, gradients summed across the parts")
        lines.append(f"  predicted step time {fmt_time(self.predicted_step_time_s)}")
        lines.extend(f"  note: {n}" for n in self.notes)
        meshes = len({s.device_ids for s in self.stages})
        if meshes > 1:
            lines.append(f"  after a step: the state lies on {meshes} stage meshes; call the step again or "
                         "hetpar.parallelize(eval_fn, like=step) as it is, hetpar.gather(state) first for plain JAX code")
        return "\n".join(lines)


def runs(values: list[int]) -> tuple[tuple[int, int], ...]:
    """`values` as (value, repeat count) runs: how a plan keeps operator stages short."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return tuple((v, n) for v, n in out)


def spec_text(spec: Spec) -> str:
    return f"PartitionSpec({', '.join(repr(a) for a in spec)})"


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.3f} us"

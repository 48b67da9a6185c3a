"""What the estimator is given: a model as a chain of layers with per-example costs,
and a cluster as a few kinds of devices with counts, speeds, memories and links.

Plain data, no JAX: `hetpar.plan.auto` builds a `Problem` from a traced step,
`solver.transformer` one for a transformer that exists only on paper, and a Plan
keeps the one it was priced with (`Plan.cost_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from solver import schedules
from solver.collectives import LinkCost
from solver.cost.measured import MeasuredLayer
from solver.memory import OFFLOAD_TIERS


class PlanningError(ValueError):
    """No plan exists under the constraints, or the problem is malformed."""


@dataclass(frozen=True)
class LayerCost:
    """One layer, per example of the batch (a sequence for a language model)."""

    flops: float  # forward + backward
    forward_flops: float
    param_bytes: int
    saved_bytes: float  # activations the backward reads
    input_bytes: float  # the activation entering the layer: what a cut before it sends, what remat keeps
    tp_bytes: float = 0.0  # all-reduced per forward under tensor parallelism (Megatron: two hidden-sized sums)
    tp_collectives: float = 2.0  # how many all-reduces carry `tp_bytes` per forward; the backward does as many
    matmuls: float = 0.0  # matmul kernels per forward (their FLOPs set their speed, `solver.efficiency`); 0: unknown, flat rate
    backward_matmuls: float = 0.0  # matmul kernels per backward; 0: as many per FLOP as the forward's
    largest_bytes: float = 0.0  # the layer's largest single activation (solver.memory's backward working set)
    unsplit_param_bytes: float = 0.0  # the part of param_bytes tensor parallelism leaves whole (an embedding table)
    # of saved_bytes, what a backward rerunning the layer's forward in its own program holds (XLA fuses the
    # rest into its readers: solver.memory's `StageActivations.recomputed`); None: as much as saved_bytes
    recomputed_bytes: float | None = None
    # what a rerunning backward holds at once besides, while this layer's backward runs (solver.memory's
    # `StageActivations.rerun_working`); None: two of largest_bytes
    rerun_working_bytes: float | None = None
    # FLOPs the backward reruns of the forward whatever the stage's recomputation (Korthikanti et al.'s
    # selective recomputation of the attention core); not in `flops`, which counts the model's work (MFU)
    recompute_flops: float = 0.0
    # bytes the layer's memory-bound operators (normalisation, softmax, activation, dropout, residual adds)
    # read and write per forward and per backward: priced at the device's memory bandwidth, on top of the
    # matmuls (a roofline per operator: these kernels never reach the matmuls' rate); 0: not counted
    elementwise_bytes: float = 0.0
    backward_elementwise_bytes: float = 0.0
    # of those bytes, the share tensor parallelism splits (1: all, as under sequence parallelism; without it
    # the norms, dropouts and residual adds run whole on every tensor-parallel device)
    elementwise_split: float = 1.0


@dataclass(frozen=True)
class DeviceKind:
    name: str
    count: int
    devices_per_node: int
    flops: float  # achievable FLOP/s per device for the model's matmuls
    memory_bytes: int
    memory_bandwidth: float
    intra: LinkCost  # between devices of one node (`shared`: host memory, where they lack peer-to-peer)
    inter: LinkCost  # between nodes of this kind: one flow's (`shared`: the node's NICs, all its devices' flows together)
    layer_overhead_s: float = 0.0  # fixed cost of one layer's forward and backward on one microbatch (kernel launches)
    peak_flops: float = 0.0  # per device, for MFU; 0: same as `flops`
    matmul_half_flops: float = 0.0  # a matmul of this many FLOPs runs at half of `flops` (`solver.efficiency`); 0: flat
    measured: bool = False  # `flops`, `matmul_half_flops`, `memory_bandwidth` and `intra` come from a profile
    # What the JAX client may use of `memory_bytes` (XLA_PYTHON_CLIENT_MEM_FRACTION on a GPU), and
    # what one process keeps of that beside the arrays (runtime context, library workspaces).
    memory_fraction: float = 1.0
    process_reserve_bytes: float = 0.0
    # The link between one device and its host's memory (PCIe): what an offloaded optimizer state
    # crosses every step (`shared`: the node's host memory, all its devices' copies together).
    host_link: LinkCost = LinkCost(25e9, 10e-6)
    # Host memory per device (the node's divided among its devices) for offloaded state; 0: unknown,
    # and nothing is offloaded to it.
    host_memory_bytes: float = 0.0
    # The node's local disk for NVMe-tier optimizer state: its read/write bandwidth (bytes/s, the
    # node's devices sharing it) and the bytes per device (the node's divided among its devices);
    # 0: none declared, and nothing goes to disk.
    nvme_bandwidth: float = 0.0
    nvme_bytes: float = 0.0
    # The kind's devices are one host's cores (CPU virtual devices): nothing on them runs side by side,
    # so a step costs the host every stage's work one after another (`solver.cost.estimate`), and a
    # stage's modelled layer times are its devices' work added up.
    shared_host: bool = False

    @property
    def usable_bytes(self) -> float:
        """What a process's arrays may fill on one device: the client's share of the
        memory less the per-process reserve (`hetpar.cluster.memory`)."""
        return max(0.0, self.memory_bytes * self.memory_fraction - self.process_reserve_bytes)

    def tp_degrees(self, max_tp: int) -> list[int]:
        """Tensor parallelism stays inside a node, where the links are fastest."""
        return [t for t in (1, 2, 4, 8, 16) if t <= min(max_tp, self.devices_per_node) and self.devices_per_node % t == 0]


def memory_note(kind: DeviceKind) -> str:
    """How much of a device of `kind` a plan may fill and what sets it, for messages
    about plans that do not fit; empty where the whole memory is usable."""
    if kind.memory_fraction >= 1 and not kind.process_reserve_bytes:
        return ""
    gib = 2**30
    return (f"a {kind.name} device has {kind.memory_bytes / gib:.1f} GiB, of which the JAX client takes "
            f"{kind.memory_fraction:.0%} (XLA_PYTHON_CLIENT_MEM_FRACTION={kind.memory_fraction:g}, or the cluster file's "
            f"memory_fraction) less a {kind.process_reserve_bytes / gib:.2f} GiB per-process reserve "
            f"(process_reserve_gib): {kind.usable_bytes / gib:.1f} GiB for the plan")


@dataclass(frozen=True)
class Problem:
    layers: tuple[LayerCost, ...]
    kinds: tuple[DeviceKind, ...]
    batch_size: int  # examples per step
    links: tuple[tuple[str, str, LinkCost], ...] = ()  # between kinds; either order
    tokens_per_example: int = 1
    # False: a forward-only function (an eval planned `like=` a train step): no backward,
    # no gradients, no optimizer state or update, no gradient sync.
    training: bool = True
    state_factor: float = 4.0  # bytes of parameters + gradients + optimizer state per parameter byte (fp32 Adam: 4)
    optimizer_traffic: float = 7.0  # bytes the update reads and writes per parameter byte
    # True: the data axis's collectives overlap compute, as DDP's buckets, Megatron's overlapped gradient
    # reduction and ZeRO's prefetch run them (`StageCosts._overlapped`: only their exposed part is priced).
    # False: each runs after the compute it follows, as hetpar's runtime runs the step's gradient sync
    # (its own program after the last backward), so plans hetpar runs are priced as they run.
    overlap_comm: bool = False
    memory_reserve: float = 0.0  # fraction of each device's usable memory (`DeviceKind.usable_bytes`) kept free for XLA's temporaries
    microbatches: tuple[int, ...] | None = None  # allowed counts; None: every divisor of the batch
    schedules: tuple[str, ...] = field(default_factory=schedules.names)
    chunks: tuple[int, ...] = (2, 4)  # stages per device group an interleaved schedule may use
    max_tp: int = 8
    allow_remat: bool = True
    # True: "full" recomputation checkpoints every layer's input and reruns one layer at a time in the
    # backward (Megatron's activation checkpointing), on every stage, the last included. False: a stage
    # reruns its whole forward in its backward program (hetpar's runtime; solver.memory).
    layer_checkpoints: bool = False
    force_remat: bool = False  # every stage recomputes its forward in the backward (Megatron's full recomputation)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)  # ZeRO stages a data-parallel stage may use (solver.memory.ZERO_STAGES)
    # Where a stage may keep its optimizer state (solver.memory.OFFLOAD_TIERS): "" on its devices,
    # "host" in host memory, "nvme" on its nodes' disks. The planner offloads only a range that fits
    # no other way (offloading only adds time), and to disk only a range host memory cannot take;
    # ("host",) or ("nvme",) forces that tier on every stage.
    offload_tiers: tuple[str, ...] = ("", "host", "nvme")
    allow_replicas: bool = True  # pipelines of different kinds side by side, splitting the batch
    allow_mixed: bool = True  # a stage's data-parallel parts on different kinds (solver/planner/mixed.py)
    use_all_kinds: bool = False  # only plans that give every kind work
    min_examples: int = 1  # per microbatch on each data-parallel device
    min_microbatch: int = 1  # examples in any pipeline's microbatch (a replica's share included)
    replica_units: int = 64  # the replica batch split is searched in steps of batch/(m x this) at most
    # Layers measured on real devices (`hetpar profile --layers`, solver.cost.measured): priced from the
    # measurement for the kinds and degrees it has, from the roofline everywhere else.
    measured_layers: tuple[MeasuredLayer, ...] = ()

    def link(self, a: str, b: str) -> LinkCost:
        if a == b:
            return self.kind(a).inter
        for x, y, cost in self.links:
            if {x, y} == {a, b}:
                return cost
        raise PlanningError(f"no link between {a} and {b}: add one to the cluster (links between groups)")

    def kind(self, name: str) -> DeviceKind:
        return next(k for k in self.kinds if k.name == name)

    def microbatch_counts(self) -> list[int]:
        counts = self.microbatches or tuple(m for m in range(1, self.batch_size + 1) if self.batch_size % m == 0)
        return sorted(m for m in counts if self.batch_size % m == 0)

    def check(self) -> None:
        if not self.layers:
            raise PlanningError("the model has no layers")
        if self.batch_size < 1:
            raise PlanningError(f"batch size must be positive, got {self.batch_size}")
        if not self.kinds or any(k.count < 1 for k in self.kinds):
            raise PlanningError("every device kind needs at least one device")
        if bad := [s for s in self.schedules if s not in schedules.names()]:
            raise PlanningError(f"unknown schedule {bad[0]!r}; known: {', '.join(schedules.names())}")
        if any(c < 1 for c in self.chunks):
            raise PlanningError(f"chunk counts must be positive, got {self.chunks}")
        if bad := [z for z in self.zero_stages if z not in (0, 1, 2, 3)]:
            raise PlanningError(f"unknown ZeRO stage {bad[0]}; use 0 (replicated), 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters)")
        if bad := [t for t in self.offload_tiers if t not in OFFLOAD_TIERS] or not self.offload_tiers:
            raise PlanningError(f"unknown offload tier {bad[0] if bad else None!r}; use '' (optimizer state on the devices), "
                                "'host' (in host memory) or 'nvme' (on the nodes' local disks)")
        if not self.microbatch_counts():
            raise PlanningError(f"none of the microbatch counts {self.microbatches} divides the batch of {self.batch_size}")

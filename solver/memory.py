"""Memory per device of a pipeline stage: the one formula the planner, hand-made
plans (`hetpar.pipeline`) and the predictor (`hetpar.predict.memory`) all use.

A device of a stage holds, for the whole step, its share of the stage's state:
parameters, gradient accumulators and optimizer state, each split over the model
axis (tensor parallelism) and, by ZeRO stage, over the data axis too (1: optimizer
state; 2: and gradients; 3: and parameters, gathered one use at a time). It also
holds the activations its forward keeps for its backward, once per microbatch the
schedule keeps in flight at the stage's position in its own pipeline
(`solver.schedules`). Recomputation trades them for time: "full" keeps only the
stage's input per microbatch and reruns the whole stage forward for one microbatch
in its backward program; "dots" keeps the matmul results without batch dimensions
as well and reruns the rest. A rerun forward holds less than the forward program
hands its backward: there every value the backward reads is a buffer of its own,
while inside the one backward program XLA fuses cheap elementwise work into what
reads it (`StageActivations.recomputed`). While a backward runs, two buffers the size of the
stage's largest activation are live besides (an operator's incoming and outgoing
cotangents): measured against XLA's memory analysis, that is most of what a backward
program needs beyond the activations it reads. A backward that reruns the forward holds, besides what the
rerun leaves, what the liveness of one layer's traced backward says it needs at most
(`StageActivations.rerun_working`): less than two of the largest buffers, as by the time the
backward makes its attention's score-sized gradients it has freed what its MLP kept. The last stage of a pipeline runs each microbatch's
forward and backward as one program, so it holds one microbatch's activations and
recomputation changes nothing there.

Bytes are plain numbers or numpy arrays of them (the planner prices every layer
range at once); no JAX: callers say what a stage holds, this module says what a
device of it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver import schedules

# Of a device's memory, the share a framework's allocator loses to fragmentation and keeps for
# its runtime (CUDA context, communication buffers, cuBLAS workspaces) beyond what the
# formulas here count: the one headroom constant, for problems priced against runs of other
# frameworks (the paper-form transformer, benchmarks/predictor_scale.py, as its
# `Problem.memory_reserve`). 10% is a round figure: PyTorch's caching allocator typically
# reserves 5-10% more than it allocates on large-model training, and the CUDA context and
# NCCL buffers take 1-3 GB of an 80 GB device. hetpar's own runtime has its own reserve
# (the cluster's memory settings), measured against XLA's allocator.
FRAGMENTATION_HEADROOM = 0.10

REMAT_POLICIES = ("", "full", "dots")  # none, nothing saved, dots without batch dims saved
ZERO_STAGES = (0, 1, 2, 3)  # 0 replicated; 1 optimizer state sharded over data; 2 + gradients; 3 + parameters
# Where a stage keeps its optimizer state between steps: "" on its devices; "host" in its nodes'
# host memory, streamed to the device for the update and back (ZeRO-Offload's split); "nvme" in
# a file store on its nodes' local disks, read through host memory to the devices for the
# update and written back (ZeRO-Infinity's third tier), for where host memory is short.
OFFLOAD_TIERS = ("", "host", "nvme")


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes on one device of a stage, by what holds them."""

    parameters: float
    gradients: float
    optimizer_state: float
    activations: float  # kept for the backward (all microbatches in flight) and the backward's recomputation
    workspace: float = 0.0  # temporaries: a gathered ZeRO-3 layer, a program's scratch
    # Host memory this device's share of the stage keeps there (offloaded optimizer state):
    # not in `total`, which is device memory; checked against the node's host memory apart.
    host: float = 0.0
    # Bytes this device's share of the stage keeps on its node's local disk (NVMe-tier
    # optimizer state): in neither memory, checked against the node's disk apart.
    nvme: float = 0.0

    @property
    def state(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        return self.state + self.activations + self.workspace


def offloaded(memory: DeviceMemory, tier: str, streamed: float | np.ndarray = 0.0) -> DeviceMemory:
    """`memory` with its optimizer state kept off the device: the device holds none of it
    between steps, only `streamed` while the update runs (the largest layer's share,
    streamed in and out one layer at a time, as ZeRO-Offload does). `tier` "host": the
    state lives in host memory. "nvme": it lives on the node's disk, and host memory
    holds only what is in flight between disk and device, `streamed` read in and as
    much written out (ZeRO-Infinity's staging buffers)."""
    if tier not in OFFLOAD_TIERS:
        raise ValueError(f"unknown offload tier {tier!r}; use one of {OFFLOAD_TIERS}")
    if not tier:
        return memory
    if tier == "nvme":
        return DeviceMemory(memory.parameters, memory.gradients, 0.0 * memory.optimizer_state, memory.activations,
                            memory.workspace + streamed, memory.host + 2 * streamed, memory.nvme + memory.optimizer_state)
    return DeviceMemory(memory.parameters, memory.gradients, 0.0 * memory.optimizer_state, memory.activations,
                        memory.workspace + streamed, memory.host + memory.optimizer_state, memory.nvme)


@dataclass(frozen=True)
class StageActivations:
    """One microbatch's activations on one device of a stage (already split over its
    data- and model-parallel devices)."""

    saved: float  # what the backward reads when nothing is recomputed
    inputs: float  # the stage's input: all that "full" recomputation keeps
    dots: float = 0.0  # matmul results without batch dims, part of `saved`: what "dots" keeps besides
    largest: float = 0.0  # the largest single activation: two such buffers are live while the backward runs
    # what a backward rerunning the forward in its own program holds of it (`saved` less what XLA fuses
    # into its readers: a softmax's output besides its exponentials is kept, its masked scores are not);
    # None: as much as `saved`
    recomputed: float | np.ndarray | None = None
    # what a backward rerunning the forward holds at once beyond `recomputed` while one layer's backward runs
    # (cotangents, the backward's temporaries: a liveness walk over the traced backward); None: 2 x `largest`
    rerun_working: float | np.ndarray | None = None


def model_split_bytes(param_bytes: float | np.ndarray, unsplit_bytes: float | np.ndarray, tp: int) -> float | np.ndarray:
    """A layer's parameter bytes on one device of a `tp`-wide model axis, as the
    sharding pass lays them out: the matmuls' weights split, what no matmul reads (an
    embedding table) whole. Under ZeRO-3 this is what a layer gathers while in use."""
    return (param_bytes - unsplit_bytes) / tp + unsplit_bytes


def in_flight(schedule: str, num_microbatches: int, position: int, num_stages: int, chunks: int = 1) -> int:
    """Microbatches whose activations stage `position` of its pipeline (`num_stages`
    stages, virtual ones under an interleaved schedule) holds at once: the schedule's
    answer. `position` counts within the stage's own pipeline, not the plan."""
    return schedules.get(schedule).in_flight(num_microbatches, position, num_stages, chunks)


def sharded_state(param_bytes: float, gradient_bytes: float, optimizer_bytes: float, dp: int, zero: int = 0) -> DeviceMemory:
    """Per device: a stage's parameters, gradients and optimizer state (each already
    divided by tensor parallelism) under ZeRO stage `zero` over `dp` data-parallel
    devices. Activations are left at 0."""
    if zero not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {zero}")
    dp = max(dp, 1)
    return DeviceMemory(
        param_bytes / dp if zero >= 3 else param_bytes,
        gradient_bytes / dp if zero >= 2 else gradient_bytes,
        optimizer_bytes / dp if zero >= 1 else optimizer_bytes,
        0.0,
    )


def activation_parts(per_microbatch: StageActivations, remat: str = "",
                     fused: bool = False) -> tuple[float | np.ndarray, float | np.ndarray, float | np.ndarray]:
    """`activation_bytes`'s three parts under `remat`: bytes per microbatch in flight,
    bytes held once (what a rerun forward holds), and the backward's working buffers.
    Apart so that the planner's stage tables price every choice at once from one set
    of parts (`solver.cost.choice_memory`) by the same sums."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown recomputation policy {remat!r}; use one of {REMAT_POLICIES}")
    a = per_microbatch
    working = 2 * a.largest  # the cotangent an operator's backward receives and the one it passes on
    if fused or not remat:
        return a.saved, 0.0, working
    dots = a.dots if remat == "dots" else 0.0
    rerun = a.saved if a.recomputed is None else a.recomputed
    if a.rerun_working is not None:
        working = a.rerun_working
    return a.inputs + dots, np.maximum(rerun - dots, 0.0), working


def activation_bytes(per_microbatch: StageActivations, held: int, remat: str = "", fused: bool = False) -> float:
    """Activations a device keeps with `held` microbatches in flight under `remat`.
    `fused`: the stage runs forward and backward as one program (a pipeline's last),
    which holds one microbatch's."""
    per_held, once, working = activation_parts(per_microbatch, remat, fused)
    return per_held * (1 if fused else held) + once + working


def stage_memory(state: DeviceMemory, per_microbatch: StageActivations, held: int, remat: str = "",
                 fused: bool = False, workspace: float = 0.0) -> DeviceMemory:
    """A device's whole need: its (sharded) state, the activations the schedule and
    recomputation keep, and `workspace` (e.g. the largest gathered ZeRO-3 layer)."""
    return DeviceMemory(state.parameters, state.gradients, state.optimizer_state,
                        activation_bytes(per_microbatch, held, remat, fused), state.workspace + workspace, state.host)

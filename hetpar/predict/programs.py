"""Predicted time and memory of one stage program (a task) on its mesh.

Work on values that carry the batch is split over the stage mesh (data parallel);
everything else is replicated. Reductions over the batch end in an all-reduce of
their bytes across the mesh: per call, or, for those the program accumulates as
per-data-shard partials (`Program.stacked`), once per step when they are finished.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from hetpar.compile.tasks import Task
from hetpar.predict.compute import ComputeModel
from hetpar.trace.flops import MATMUL_OPS, op_costs
from hetpar.trace.fusion import materialized, own_kernel
from hetpar.trace.microbatch import MicrobatchAnalysis
from hetpar.trace.opgraph import OpGraph
from solver.collectives import LinkCost, Topology, best


@dataclass(frozen=True)
class ProgramEstimate:
    compute_s: float
    communication_s: float
    argument_bytes: int  # per device
    output_bytes: int  # per device
    temp_bytes: int  # per device: peak of intermediates the program materializes
    finish_s: float = 0.0  # once per step: the all-reduce of the reductions kept as partials across calls

    @property
    def time_s(self) -> float:
        return self.compute_s + self.communication_s

    @property
    def memory_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes


def share(graph: OpGraph, analysis: MicrobatchAnalysis, value: int, mesh_size: int) -> float:
    """The fraction of `value` each device of a data-parallel mesh holds."""
    axis = analysis.batch_axis.get(value)
    if axis is not None and mesh_size > 1 and graph.avals[value].shape[axis] % mesh_size == 0:
        return 1.0 / mesh_size
    return 1.0


@dataclass(frozen=True)
class TimeTerms:
    """A program's predicted compute time by kind, before the fitted corrections:
    the calibration fits one scale per kind against measured programs."""

    launch_s: float
    matmul_s: float
    vector_s: float
    kernels: int  # matmuls, reductions and fusions: each costs the device a fixed overhead
    transpose_s: float = 0.0  # transposes (strided copies), apart from the rest of the vector work

    def scaled(self, compute: ComputeModel) -> float:
        return (
            compute.launch_scale * self.launch_s
            + compute.matmul_scale * self.matmul_s
            + compute.vector_scale * self.vector_s
            + compute.transpose_scale * self.transpose_s
            + self.kernels * compute.op_overhead_s
        )


def time_terms(task: Task, graph: OpGraph, analysis: MicrobatchAnalysis, mesh_size: int, compute: ComputeModel) -> TimeTerms:
    costs = op_costs(graph)
    members = set(task.ops)
    boundary = set(task.inputs) | set(task.outputs) | set(task.reductions)
    matmul = vector = transpose = 0.0
    kernels = 0
    for i in task.ops:
        op, cost = graph.ops[i], costs[i]
        # An op touching any batch-split value is split: its other operands are replicated.
        split = min((share(graph, analysis, v, mesh_size) for v in op.inputs + op.outputs), default=1.0)
        if own_kernel(op.name):
            bytes_in, bytes_out = cost.bytes_in, cost.bytes_out
        else:  # fused: only buffers shared with unfused work or the program's boundary move
            bytes_in = sum(graph.nbytes(v) for v in op.inputs if v in boundary or not _fused_value(graph, v, members))
            bytes_out = sum(graph.nbytes(v) for v in op.outputs if v in boundary or not _fused_value(graph, v, members))
        seconds = compute.raw_op_time(op.name, cost.flops * split, bytes_in * split, bytes_out * split)
        # A fusion is a kernel per buffer it writes; a materialized operator is one kernel.
        kernels += 1 if own_kernel(op.name) else sum(
            1 for v in op.outputs if v in boundary or not _fused_value(graph, v, members)
        )
        if op.name in MATMUL_OPS:
            matmul += seconds
        elif op.name == "transpose":
            transpose += seconds
        else:
            vector += seconds
    launch = compute.raw_launch_time(len(task.inputs) + len(task.outputs) + 2 * len(task.reductions))
    return TimeTerms(launch, matmul, vector, kernels, transpose)


def estimate_task(
    task: Task,
    graph: OpGraph,
    analysis: MicrobatchAnalysis,
    mesh_size: int,
    compute: ComputeModel,
    allreduce: LinkCost,
    stacked: frozenset[int] = frozenset(),
) -> ProgramEstimate:
    """`stacked`: the reductions this program accumulates unreduced (compiled
    `Program.stacked`), all-reduced once per step (`finish_s`) rather than per call."""
    total = time_terms(task, graph, analysis, mesh_size, compute).scaled(compute)

    def all_reduce_s(values: list[int]) -> float:
        # XLA combines a program's all-reduces into one, so latency is paid once, not per gradient.
        reduced = sum(graph.nbytes(v) for v in values)
        return best("all_reduce", Topology(1, mesh_size, allreduce, allreduce), reduced)[1] if mesh_size > 1 and reduced else 0.0

    comm = all_reduce_s([v for v in task.reductions if v not in stacked])
    finish = all_reduce_s([v for v in task.reductions if v in stacked])

    def per_device(values: list[int]) -> int:
        return int(sum(graph.nbytes(v) * share(graph, analysis, v, mesh_size) for v in values))

    arguments = per_device(task.inputs) + per_device(task.reductions)  # accumulators come in
    outputs = per_device(task.outputs) + per_device(task.reductions)
    return ProgramEstimate(total, comm, arguments, outputs, _temp_bytes(task, graph, analysis, mesh_size), finish)


def _temp_bytes(task: Task, graph: OpGraph, analysis: MicrobatchAnalysis, mesh_size: int) -> int:
    """Peak bytes of intermediates live at once, counting only values XLA materializes:
    results of matmuls, reductions and other non-fusible ops, and elementwise results
    still needed after a later matmul (a fusion cannot reach across it: the forward
    activations a fused forward-and-backward program keeps for its backward)."""
    boundary = set(task.inputs) | set(task.outputs) | set(task.reductions)
    last_use: dict[int, int] = {}
    for i in task.ops:
        for v in graph.ops[i].inputs:
            last_use[v] = i
    heavy = [i for i in task.ops if materialized(graph.ops[i].name)]
    live, peak = 0.0, 0.0
    alive: dict[int, float] = {}
    for i in task.ops:
        op = graph.ops[i]
        for v in op.outputs:
            if v in boundary or v not in last_use:
                continue
            if not materialized(op.name) and not _crosses(heavy, i, last_use[v]):
                continue
            alive[v] = graph.nbytes(v) * share(graph, analysis, v, mesh_size)
            live += alive[v]
        peak = max(peak, live)
        for v in op.inputs:
            if v in alive and last_use.get(v) == i:
                live -= alive.pop(v)
    return int(peak)


def _crosses(heavy: list[int], start: int, end: int) -> bool:
    """Whether a materializing operator runs strictly between op `start` and op `end`
    (`heavy` is sorted)."""
    k = bisect.bisect_right(heavy, start)
    return k < len(heavy) and heavy[k] < end


def _fused_value(graph: OpGraph, value: int, members: set[int]) -> bool:
    """A value that lives only inside a fusion: made and read by fusible operators."""
    producer = graph.producer.get(value)
    if producer is None or producer not in members or own_kernel(graph.ops[producer].name):
        return False
    return all(c in members and not own_kernel(graph.ops[c].name) for c in graph.consumers.get(value, ()))

"""Between the traced step and the solver's planner: a step's layers and a Cluster
become a `solver.planner.Problem`; the planner's choice becomes a `Plan` on the
cluster's devices.

The planner prices tensor parallelism from each layer's Megatron-style estimate
(`Layers.tp_bytes`); a stage it gives `dp x tp` devices runs on a `data` x `model`
mesh whose final split and layouts the intra-op ILP decides. The planner may
recompute a stage's forward ("full", run by hetpar.compile.remat) and shard its state
over the data axis (ZeRO 1-3) where memory or time asks, priced by solver.memory;
`parallelize` keeps the step's own microbatch count.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hetpar.cluster.cluster import Cluster, DeviceGroup
from hetpar.errors import PlanError
from hetpar.plan.model import ClusterGroup, Plan, StagePlan
from hetpar.trace.layers import Layers
from solver.collectives import LinkCost
from solver import schedules
from solver.planner import DeviceKind, LayerCost, PlanChoice, Planner, PlanningError, Problem, SearchResult
from solver.planner.search import FINALISTS


@dataclass(frozen=True)
class SearchOptions:
    """What the planner may choose. `None` microbatches: any count dividing the batch."""

    microbatches: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = field(default_factory=schedules.names)
    chunks: tuple[int, ...] = (2, 4)  # stages per device group an interleaved schedule may use
    max_tp: int = 8  # within a node
    allow_remat: bool = True  # recompute a stage's forward in its backward where memory needs it (hetpar.compile.remat)
    force_remat: bool = False  # full recomputation on every stage (what large runs do)
    # ZeRO stages a data-parallel stage may use (solver.planner.Problem prices each): a
    # stage takes the fastest that fits, and the sharding pass lays out the one it took.
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    # Where a stage may keep its optimizer state (solver.memory.OFFLOAD_TIERS): the planner
    # offloads to host memory only where a stage fits no other way, and to a local disk only
    # where host memory is short too; ("host",) or ("nvme",) forces that tier.
    offload_tiers: tuple[str, ...] = ("", "host", "nvme")
    # Pipelines side by side, each on a share of every microbatch, and a stage's data-parallel
    # parts on different kinds, each running its rows of every microbatch (solver/planner/mixed.py):
    # not for a step whose microbatch work mixes examples (hetpar.value_and_grad's batch
    # statistics, a step run whole), which each pipeline or part would compute over its own rows.
    allow_replicas: bool = True
    allow_mixed: bool = True
    dtype: str = "float32"
    top_k: int = 5
    min_microbatch: int = 1  # examples in any pipeline's microbatch
    time_limit_s: float | None = None  # None: search until the best plan is proven
    finalists: int = FINALISTS  # the search's best plans by its closed form that the estimator ranks
    layer_overhead_s: float = 50e-6  # kernel launches of one layer's forward and backward, catalog default
    memory_reserve: float = 0.1  # of each device's memory, for XLA's workspace beyond the arrays the model counts
    use_all_kinds: bool = False  # only plans that give every device kind of the cluster work
    # Measured figures per device type (`hetpar profile`, read by the pipeline), used in
    # place of the catalog's for the kinds they name.
    measured: tuple[tuple[str, "Measured"], ...] = ()


@dataclass(frozen=True)
class Measured:
    """What `hetpar profile` measured of one device kind, per device: sustained matmul
    FLOP/s and the matmul size that reaches half of it, memory bandwidth, and the
    all-reduce link among a node's devices (None: the cluster file's)."""

    matmul_flops: float
    matmul_half_flops: float
    memory_bandwidth: float
    intra: LinkCost | None = None
    shared_host: bool = False  # CPU virtual devices: one host's cores (solver DeviceKind.shared_host)


def device_kinds(cluster: Cluster, dtype: str = "float32", layer_overhead_s: float = 50e-6,
                 measured: dict[str, Measured] | None = None) -> tuple[DeviceKind, ...]:
    """One kind per cluster group, named by the group's label: the catalog's figures,
    or the measured ones where `measured` has the group's device type."""
    kinds = []
    for g in cluster.groups:
        spec = g.spec  # the catalog's figures with the cluster file's overrides for this group
        intra = g.intra_cost()
        per_node = g.devices_per_node or g.size
        flops, half, bandwidth = spec.matmul_flops(dtype) * spec.efficiency, spec.matmul_half_flops, spec.memory_bandwidth
        seen = (measured or {}).get(g.type_name)
        if seen is not None:
            flops, half, bandwidth, intra = seen.matmul_flops, seen.matmul_half_flops, seen.memory_bandwidth, seen.intra or intra
        kinds.append(DeviceKind(
            g.label, g.size, per_node, flops, spec.memory_bytes, bandwidth,
            intra, g.inter_cost() if g.size > per_node else intra, layer_overhead_s, spec.matmul_flops(dtype),
            half, measured=seen is not None, memory_fraction=g.client_memory().fraction,
            process_reserve_bytes=spec.process_reserve_bytes, host_link=g.host_cost(),
            host_memory_bytes=g.host_memory_per_device(), nvme_bandwidth=g.nvme_bandwidth,
            nvme_bytes=g.nvme_bytes / per_node, shared_host=seen is not None and seen.shared_host,
        ))
    return tuple(kinds)


def group_links(cluster: Cluster) -> tuple[tuple[str, str, LinkCost], ...]:
    groups = cluster.groups
    return tuple((a.label, b.label, cluster.link_cost_between(a, b)) for i, a in enumerate(groups) for b in groups[i + 1 :])


def layer_costs(layers: Layers, batch_size: int) -> tuple[LayerCost, ...]:
    """A traced step's layers, per example."""
    n = layers.num_layers
    per = lambda values: [v / batch_size for v in values] if values else [0.0] * n  # noqa: E731
    forward = per(layers.forward_flops) if layers.forward_flops else [f / 3 / batch_size for f in layers.flops]
    return tuple(
        LayerCost(f, fw, int(p), s, i, t, c, largest_bytes=g, unsplit_param_bytes=u, matmuls=mf, backward_matmuls=mb,
                  recomputed_bytes=r, rerun_working_bytes=rw)
        for f, fw, p, s, i, t, c, g, u, mf, mb, r, rw in zip(
            per(layers.flops), forward, layers.param_bytes or [0] * n, per(layers.saved_bytes), per(layers.boundary_bytes),
            per(layers.tp_bytes), layers.tp_count or [2] * n, per(layers.largest_bytes), layers.unsplit_param_bytes or [0] * n,
            layers.matmuls or [0] * n, layers.backward_matmuls or [0] * n,
            per(layers.recomputed_bytes) if layers.recomputed_bytes else [None] * n,
            per(layers.rerun_working_bytes) if layers.rerun_working_bytes else [None] * n)
    )


def problem_for(layers: Layers, cluster: Cluster, batch_size: int, tokens_per_example: int = 1,
                options: SearchOptions = SearchOptions()) -> Problem:
    return Problem(
        layer_costs(layers, batch_size), device_kinds(cluster, options.dtype, options.layer_overhead_s, dict(options.measured)),
        batch_size, group_links(cluster),
        tokens_per_example=tokens_per_example, microbatches=options.microbatches, schedules=options.schedules, chunks=options.chunks,
        max_tp=options.max_tp, allow_remat=options.allow_remat, force_remat=options.force_remat, allow_replicas=options.allow_replicas,
        allow_mixed=options.allow_mixed,
        zero_stages=options.zero_stages, use_all_kinds=options.use_all_kinds, offload_tiers=options.offload_tiers,
        min_microbatch=options.min_microbatch,
        memory_reserve=options.memory_reserve,
    )


def search(layers: Layers, cluster: Cluster, batch_size: int, tokens_per_example: int = 1,
           options: SearchOptions = SearchOptions()) -> tuple[Plan, SearchResult]:
    """The planner's best plan for these layers on this cluster, as a Plan."""
    return search_problem(layers, cluster, planner_for(problem_for(layers, cluster, batch_size, tokens_per_example, options), options))


def planner_for(problem: Problem, options: SearchOptions) -> Planner:
    """The planner of `problem` under the search's limits (kept by a caller that asks it
    more than one question: its tables and pipelines serve them all)."""
    try:
        return Planner(problem, top_k=options.top_k, time_limit_s=options.time_limit_s, finalists=options.finalists)
    except PlanningError as e:
        raise PlanError(str(e)) from None


def search_problem(layers: Layers, cluster: Cluster, planner: Planner) -> tuple[Plan, SearchResult]:
    """The planner's best plan for its problem (these layers' costs on this cluster)."""
    try:
        result = planner.solve()
    except PlanningError as e:
        raise PlanError(str(e)) from None
    return replace(to_plan(result.best, layers, cluster, result.bound_ratio), cost_inputs=planner.problem), result


def to_plan(choice: PlanChoice, layers: Layers, cluster: Cluster, bound_ratio: float | None = None) -> Plan:
    """Stages take the devices of their group in order, a stage's `dp * tp` at a time;
    under an interleaved schedule, stage p of a pipeline is chunk p // D on the
    devices of its stage p mod D. A mixed stage's other parts (listed after the
    pipeline's stages) take the next devices of their groups: the ones it left idle."""
    positions = {d: i for i, d in enumerate(d for g in cluster.groups for d in g.device_ids)}
    groups = {g.label: g for g in cluster.groups}
    taken = {label: 0 for label in groups}
    batch = sum(choice.replica_batch)
    stages = []
    homes: dict[int, list[tuple[int, ...]]] = {}  # per replica: each device group's devices
    for index, s in enumerate(choice.stages):
        group: DeviceGroup = groups[s.kind]
        row = homes.setdefault(s.replica, [])
        per_replica = sum(1 for c in choice.stages if c.replica == s.replica and c.part_of < 0) // choice.chunks
        position = sum(1 for c in choice.stages[:index] if c.replica == s.replica and c.part_of < 0)
        if s.part_of >= 0:  # a mixed stage's part: devices of its own, after the pipeline's
            ids = group.device_ids[taken[s.kind] : taken[s.kind] + s.devices]
            taken[s.kind] += s.devices
        elif position < per_replica:
            row.append(group.device_ids[taken[s.kind] : taken[s.kind] + s.devices])
            taken[s.kind] += s.devices
        if s.part_of < 0:
            ids = row[position % per_replica]
        names = layers.names[s.layer_start : s.layer_end]
        label = names[0] if len(names) == 1 else f"{names[0].split('..')[0]}..{names[-1].split('..')[-1]}"
        share = choice.replica_batch[s.replica] / batch
        flops = sum(layers.flops[s.layer_start : s.layer_end])
        speed = s.devices * group.spec.matmul_flops()
        stages.append(StagePlan(
            index, group.type_name, tuple(positions[d] for d in ids), s.layer_start, s.layer_end, label, flops, speed,
            (s.forward_s + s.backward_s) * choice.num_microbatches, group=s.kind,
            mesh_shape=(s.dp, s.tp) if s.tp > 1 else (s.devices,),
            data_parallel=s.dp, tensor_parallel=s.tp, batch_share=share, forward_s=s.forward_s, backward_s=s.backward_s,
            send_s=s.send_s, sync_s=s.sync_s + choice.cross_sync_s, optimizer_s=s.optimizer_s, memory_bytes=s.memory_bytes,
            memory_capacity=s.memory_capacity, replica=s.replica,
            chunk=stages[s.part_of].chunk if s.part_of >= 0 else position // per_replica,
            remat="full" if s.remat else "", zero=s.zero, offload=s.offload, part_of=s.part_of, examples=s.examples,
        ))
    return Plan(
        tuple(stages), choice.num_microbatches, layers.num_layers, cluster.describe(), choice.schedule,
        cluster_groups=tuple(ClusterGroup(g.label, g.type_name, g.size) for g in cluster.groups),
        model_flops=sum(layers.flops), peak_flops=choice.peak_flops,
        replica_batch=choice.replica_batch if len(choice.replica_batch) > 1 else (),
        bound_ratio=bound_ratio,
    )

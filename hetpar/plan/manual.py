"""Stage assignment by hand: when the user fixes `num_stages` or `num_replicas`,
contiguous layers go to that many stages, one device group each, in proportion to
each stage's speed. Without them the planner (`hetpar.plan.auto`) decides."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from hetpar.cluster.cluster import Cluster, DeviceGroup
from hetpar.errors import PlanError
from hetpar.plan.model import ClusterGroup, Plan, StagePlan
from hetpar.trace.layers import Layers
from solver.collectives import LinkCost
from solver.partition import min_max_cuts
from solver.schedules import DEFAULT


def stage_groups(cluster: Cluster, num_stages: int) -> list[DeviceGroup]:
    """Device groups for `num_stages` stages: whole type groups when the counts match,
    otherwise type groups split evenly (more stages go to larger groups)."""
    groups = list(cluster.groups)
    if num_stages < 1:
        raise PlanError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > cluster.num_devices:
        raise PlanError(f"{num_stages} stages need at least {num_stages} devices; the cluster has {cluster.num_devices}")
    if num_stages <= len(groups):
        ranked = sorted(groups, key=lambda g: -g.size * g.spec.matmul_flops())[:num_stages]
        return [g for g in groups if g in ranked]
    per_group = _stages_per_group([g.size for g in groups], num_stages)
    out = []
    for group, k in zip(groups, per_group):
        size = group.size // k
        out += [DeviceGroup(group.type_name, group.device_ids[i * size : (i + 1) * size]) for i in range(k)]
    return out


def _stages_per_group(sizes: list[int], num_stages: int) -> list[int]:
    """Stages per group: each count divides its group evenly; among the ways to reach
    `num_stages`, the one whose smallest stage is largest."""
    divisors = [[d for d in range(1, s + 1) if s % d == 0] for s in sizes]
    options = [c for c in itertools.product(*divisors) if sum(c) == num_stages]
    if not options:
        raise PlanError(
            f"cannot split device groups of sizes {sizes} evenly into {num_stages} stages; "
            "choose a stage count that each group's size can be divided into"
        )
    return list(max(options, key=lambda c: (min(s // k for s, k in zip(sizes, c)), [-k for k in c])))


def assign_stages(
    layers: Layers, cluster: Cluster, num_stages: int, num_microbatches: int, schedule: str = DEFAULT,
    mesh_shape: tuple | None = None, uniform: bool = False, chunks: int = 1, speeds: dict[str, float] | None = None,
) -> Plan:
    """Layers over `num_stages` stages in proportion to each stage's speed (`speeds`:
    sustained FLOP/s per device by cluster group, the estimator's; else the catalog's
    peak), or (`uniform`) the same number of layers each, as Megatron splits. With
    `chunks` > 1 (an interleaved schedule) `num_stages` device groups hold `chunks`
    stages each: stage i runs on group i mod num_stages, as chunk i // num_stages.
    Decisions only: the planning pass prices the plan with the estimator."""
    groups = stage_groups(cluster, num_stages)
    num_stages, groups = num_stages * chunks, groups * chunks
    if num_stages > layers.num_layers:
        raise PlanError(f"{num_stages} stages need at least {num_stages} layers; the model was cut into {layers.num_layers}")
    peaks = [g.size * g.spec.matmul_flops() for g in groups]
    rates = [g.size * (speeds or {}).get(_group_of(cluster, g).label, g.spec.matmul_flops()) for g in groups]
    if uniform:
        cuts = [round(i * layers.num_layers / num_stages) for i in range(1, num_stages)]
    else:
        cuts = min_max_cuts(layers.flops, range(1, layers.num_layers), num_stages, part_speeds=rates)
    bounds = list(zip([0] + cuts, cuts + [layers.num_layers]))
    positions = _positions(cluster)
    stages = []
    for i, (group, (start, end), peak) in enumerate(zip(groups, bounds, peaks)):
        shape = _mesh_shape(mesh_shape, group.size, i)
        flops = sum(layers.flops[start:end])
        names = layers.names[start:end]
        label = names[0] if len(names) == 1 else f"{names[0].split('..')[0]}..{names[-1].split('..')[-1]}"
        stages.append(StagePlan(
            i, group.type_name, tuple(positions[d] for d in group.device_ids) if positions else group.device_ids,
            start, end, label, flops, peak, 0.0,
            group=_group_of(cluster, group).label,
            mesh_shape=shape,
            data_parallel=shape[0],
            tensor_parallel=math.prod(shape[1:]),
            memory_capacity=group.spec.memory_bytes,
            chunk=i * chunks // num_stages,
        ))
    return Plan(
        tuple(stages), num_microbatches, layers.num_layers, cluster.describe(), schedule,
        cluster_groups=tuple(ClusterGroup(g.label, g.type_name, g.size) for g in cluster.groups),
        model_flops=sum(layers.flops),
        peak_flops=sum(peaks) / chunks,
    )


def _mesh_shape(wanted: tuple | None, devices: int, stage: int) -> tuple[int, ...]:
    """One (data, model) shape for every stage, or one per stage; (data, model,
    model2) for a 3-axis mesh (3D tensor parallelism)."""
    if not wanted:
        return (devices,)
    if isinstance(wanted[0], tuple | list):
        if stage >= len(wanted):
            raise PlanError(f"mesh_shape gives {len(wanted)} shapes; the plan has more stages: give one per stage")
        wanted = tuple(wanted[stage])
    if len(wanted) not in (2, 3) or math.prod(wanted) != devices:
        raise PlanError(f"mesh_shape {tuple(wanted)} does not fit stage {stage}'s {devices} devices: give (data, model) "
                        f"or (data, model, model2) sizes whose product is {devices}, or more stages")
    return tuple(wanted)


def assign_replicas(
    layers: Layers, cluster: Cluster, num_replicas: int, stages_per_replica: int, num_microbatches: int,
    batch_size: int, schedule: str = DEFAULT, uniform: bool = False, chunks: int = 1, speeds: dict[str, float] | None = None,
) -> Plan:
    """Data parallelism across device types: `num_replicas` pipelines, each on its own
    devices, each taking a share of the batch in proportion to its speed (a replica
    twice as fast takes twice the examples). Gradients are summed across replicas
    before the update, so the result is the full batch's."""
    if num_replicas == 1:
        return assign_stages(layers, cluster, stages_per_replica, num_microbatches, schedule, uniform=uniform, chunks=chunks,
                             speeds=speeds)
    homes = stage_groups(cluster, num_replicas)
    rates = [g.size * (speeds or {}).get(_group_of(cluster, g).label, g.spec.matmul_flops()) for g in homes]
    examples = split_batch(batch_size, num_microbatches, rates)
    stages: list[StagePlan] = []
    positions = _positions(cluster)
    for r, (home, share) in enumerate(zip(homes, examples)):
        if home.size % stages_per_replica:
            raise PlanError(
                f"replica {r} has {home.size} {home.type_name} devices, which do not split evenly into {stages_per_replica} stages"
            )
        size = home.size // stages_per_replica
        parts = tuple(DeviceGroup(home.type_name, home.device_ids[i * size : (i + 1) * size], name=_group_of(cluster, home).label,
                                  nodes=1, devices_per_node=size) for i in range(stages_per_replica))
        sub = assign_stages(layers, replace(cluster, groups=parts), stages_per_replica, num_microbatches, schedule,
                            uniform=uniform, chunks=chunks, speeds=speeds)
        fraction = share / batch_size
        for st in sub.stages:
            stages.append(replace(
                st, index=len(stages), replica=r, batch_share=fraction,
                device_ids=tuple(positions[d] for d in parts[st.index % stages_per_replica].device_ids),  # stage i on part i mod k
                group=_group_of(cluster, home).label,
            ))
    return Plan(
        tuple(stages), num_microbatches, layers.num_layers, cluster.describe(), schedule,
        cluster_groups=tuple(ClusterGroup(g.label, g.type_name, g.size) for g in cluster.groups),
        model_flops=sum(layers.flops), peak_flops=sum(g.size * g.spec.matmul_flops() for g in homes), replica_batch=tuple(examples),
    )


def split_batch(batch_size: int, num_microbatches: int, speeds: list[float]) -> list[int]:
    """Examples per replica, in proportion to speed, each a positive multiple of the
    microbatch count (the largest remainders get the leftover)."""
    if batch_size % num_microbatches:
        raise PlanError(f"batch size {batch_size} is not divisible by num_microbatches={num_microbatches}")
    units = batch_size // num_microbatches
    if units < len(speeds):
        raise PlanError(
            f"{len(speeds)} replicas need at least {len(speeds)} examples per microbatch; the batch of {batch_size} "
            f"in {num_microbatches} microbatches has {units}: use fewer microbatches or a larger batch"
        )
    # At least two examples per microbatch where the batch allows: JAX traces size-1
    # dimensions differently, so a one-example microbatch may not match the program.
    floor = 2 if units >= 2 * len(speeds) else 1
    exact = [units * v / sum(speeds) for v in speeds]
    counts = [max(floor, int(x)) for x in exact]
    while sum(counts) > units:
        counts[max((i for i in range(len(counts)) if counts[i] > floor), key=lambda i: counts[i] - exact[i])] -= 1
    while sum(counts) < units:
        counts[max(range(len(counts)), key=lambda i: exact[i] - counts[i])] += 1
    return [c * num_microbatches for c in counts]


def link_cost(link) -> LinkCost:  # noqa: ANN001
    """A catalog link as the solver's alpha-beta cost."""
    return LinkCost(link.bandwidth, link.latency, overlaps=getattr(link, "overlaps", True))


def _positions(cluster: Cluster) -> dict[int, int]:
    """Device id -> position in the cluster's device order (what plan files record)."""
    ids = [d for g in cluster.groups for d in g.device_ids]
    return {d: i for i, d in enumerate(ids)}


def _group_of(cluster: Cluster, group: DeviceGroup) -> DeviceGroup:
    ids = set(group.device_ids)
    return next((g for g in cluster.groups if ids <= set(g.device_ids)), group)

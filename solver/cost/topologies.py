"""How a stage's collectives see its devices: which of them talk over a node's link
and which across nodes, and how many flows share each link at once. Every price of
a stage's tensor-parallel, data-parallel, ZeRO and hybrid-sharding collectives
starts from one of these (`StageCosts`, `collectives_used`), so the planner's
tables, the estimator and `show`'s collectives table see the same devices; and the
sum of shares between a mixed stage's parts or a plan's replicas is the collective
`shares_sum` names, as the runtime makes it."""

from __future__ import annotations

from dataclasses import replace
import numpy as np

from solver.collectives import Topology, best, fastest_times
from solver.cost.problem import DeviceKind
from solver.cost.stage_config import StageConfig
from solver.zero import zero_time


def tp_topology(kind: DeviceKind, tp: int) -> Topology:
    """A stage's tensor-parallel devices: `tp` devices of one node over its link."""
    return Topology(1, tp, kind.intra, kind.intra)


def dp_topology(kind: DeviceKind, cfg: StageConfig) -> Topology:
    """The stage's data-parallel devices: `tp`-wide groups of a node's devices, one
    device of each group per data-parallel rank."""
    per_node = max(1, kind.devices_per_node // cfg.tp)
    nodes = max(1, cfg.dp // per_node)
    # The tp groups of a node reduce side by side: their flows share its NICs and host memory.
    groups = min(cfg.tp, kind.devices_per_node)
    return Topology(nodes, min(per_node, cfg.dp), kind.intra.shared_by(groups), kind.inter.shared_by(groups))


def zero_topology(kind: DeviceKind, cfg: StageConfig, zero: int) -> Topology:
    """The devices ZeRO's collectives (stage `zero`) run over: the data axis, or on a
    hybrid stage its in-node shard group, `zero_group` ranks of one node (the node's
    other tp groups and shard groups reducing side by side)."""
    if not (zero and cfg.hybrid):
        return dp_topology(kind, cfg)
    return dp_topology(kind, replace(cfg, dp=cfg.zero_group, zero_group=0))  # a group as a data axis of its own


def across_topology(kind: DeviceKind, cfg: StageConfig) -> Topology:
    """A hybrid stage's replicas as the gradient all-reduce between them sees them:
    one device of each of `dp / zero_group` groups (one group per node when a group
    fills a node; several of a node's groups meet over its own link), every device
    of a group running its own shard's all-reduce at once, sharing the links."""
    replicas, group = cfg.dp // cfg.zero_group, cfg.zero_group * cfg.tp
    per_node = max(1, min(kind.devices_per_node // group, replicas))
    flows = min(group, kind.devices_per_node)
    return Topology(max(1, replicas // per_node), per_node, kind.intra.shared_by(flows), kind.inter.shared_by(flows))


def all_reduce_times(topo: Topology, nbytes: np.ndarray) -> np.ndarray:
    """The fastest all-reduce for every size in `nbytes` at once (0 for nothing)."""
    return fastest_times("all_reduce", topo, nbytes)


def shares_sum(holders: int) -> tuple[str, int]:
    """The collective a sum of `holders` shares is as the runtime makes it
    (`hetpar/runtime/sums.py`: a mixed stage's parts, a plan's replicas), and its
    message in shares. Every holder adds all shares itself in one order, so every
    share crosses to every other holder: for two, each whole share to the other, what
    the all-reduce of one share moves (its price); for three or more, each holder gets
    the `holders - 1` others' whole shares, the all-gather of all of them (k / 2 times
    the 2 (k - 1) / k of one share a ring all-reduce would move into each)."""
    return ("all_reduce", 1) if holders <= 2 else ("all_gather", holders)


def shares_sum_s(topo: Topology, holders: int, share_bytes: float) -> float:
    """Seconds of `shares_sum` over `topo`, each stream's share `share_bytes`: the
    registry's fastest algorithm for that collective, topology and size."""
    collective, shares = shares_sum(holders)
    return best(collective, topo, shares * share_bytes)[1]


def shares_sum_times(topo: Topology, holders: int, share_bytes: np.ndarray) -> np.ndarray:
    """`shares_sum_s` for every size in `share_bytes` at once."""
    collective, shares = shares_sum(holders)
    return fastest_times(collective, topo, shares * np.asarray(share_bytes, dtype=float))


def exposed(comm: np.ndarray, comm_first: np.ndarray, compute: np.ndarray, compute_first: np.ndarray) -> np.ndarray:
    """The part of bucketed communication compute cannot hide, per layer range: the
    buckets run one after another on their own stream, each once its layer's compute
    is done, so the compute of every layer but the one finishing last (`compute_first`:
    the last bucket's layer, whose bucket can only start when all compute is done)
    hides them, and at least that last bucket (`comm_first`) shows. For n equal layers
    of c seconds of communication and p of compute this is exactly
    c + (n - 1) * max(c - p, 0), what running the buckets event by event gives."""
    return np.clip(np.maximum(comm_first, comm - (compute - compute_first)), 0.0, comm)


def tp_allreduce_s(kind: DeviceKind, tp: int, nbytes: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Seconds of one pass's tensor-parallel all-reduces per layer: `count` sums
    sharing `nbytes` (Megatron: two per forward, two per backward, each once)."""
    if tp == 1:
        return np.zeros_like(nbytes)
    count = np.maximum(count, 1.0)
    return count * all_reduce_times(tp_topology(kind, tp), nbytes / count)


def across_nodes_s(kind: DeviceKind, cfg: StageConfig, grads: np.ndarray) -> np.ndarray | float:
    """A hybrid stage's once-per-step traffic across nodes: each device's shard of
    the gradient (1/zero_group of it, after the in-node reduce-scatter) all-reduced
    with its counterparts on the other replicas. 0 for any other stage."""
    if not cfg.hybrid:
        return 0.0 * grads
    return fastest_times("all_reduce", across_topology(kind, cfg), grads / cfg.zero_group)


def dp_sync_s(kind: DeviceKind, cfg: StageConfig, grads: np.ndarray) -> np.ndarray:
    """ZeRO-0's gradient all-reduce, once per step (`solver.zero.zero_time`)."""
    if cfg.dp == 1:
        return np.zeros_like(grads)
    return zero_time(grads, grads, 0, dp_topology(kind, cfg)).step

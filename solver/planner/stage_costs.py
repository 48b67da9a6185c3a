"""The cost of one stage for every range of layers it could hold, as matrices.

A stage is `dp * tp` devices of one kind running layers [i, j) on microbatches of
`b` examples. Entry [i, j] of each matrix is that range's forward and backward time
per microbatch, its memory per device, and its once-per-step tail (gradient
all-reduce over the data-parallel devices, then the optimizer). Prefix sums make a
whole matrix a few numpy operations, which is what lets the search score thousands
of stage layouts in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from solver.collectives import Topology, affine_costs
from solver.efficiency import matmul_rate
from solver import schedules
from solver.planner.problem import DeviceKind, Problem

INF = float("inf")


@dataclass(frozen=True)
class StageConfig:
    kind: str
    dp: int
    tp: int

    @property
    def devices(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True)
class PerLayer:
    """Per layer, on one device of a stage, for one microbatch."""

    forward: np.ndarray  # seconds
    backward: np.ndarray
    state: np.ndarray  # bytes of parameters, gradients and optimizer state
    saved: np.ndarray  # bytes of activations kept for the backward
    inputs: np.ndarray  # bytes of the layer's input (all that remat keeps)


@dataclass(frozen=True)
class StageTable:
    """Everything about one stage position, for all layer ranges [i, j) (i < j)."""

    forward: np.ndarray  # (L+1, L+1) seconds per microbatch, inf where the range does not fit
    backward: np.ndarray
    remat: np.ndarray  # bool: the range fits only by recomputing its forward
    memory: np.ndarray  # bytes per device
    tail: np.ndarray  # gradient sync + optimizer, seconds per step
    sync: np.ndarray
    capacity: int

    @cached_property
    def time(self) -> np.ndarray:
        return self.forward + self.backward


def _span(prefix: np.ndarray) -> np.ndarray:
    """[i, j] = prefix[j] - prefix[i]; the lower triangle is never used."""
    return prefix[None, :] - prefix[:, None]


def _range_max(values: np.ndarray) -> np.ndarray:
    n = len(values)
    out = np.zeros((n + 1, n + 1))
    for i in range(n):
        out[i, i + 1 :] = np.maximum.accumulate(values[i:])
    return out


class StageCosts:
    """Cached stage tables for one problem."""

    def __init__(self, problem: Problem):
        self.problem = problem
        layers = problem.layers
        self.n = len(layers)
        self.flops = np.array([layer.flops for layer in layers])
        self.fwd_flops = np.array([layer.forward_flops for layer in layers])
        self.params = np.array([layer.param_bytes for layer in layers], dtype=float)
        self.saved = np.array([layer.saved_bytes for layer in layers])
        self.inputs = np.array([layer.input_bytes for layer in layers])
        self.tp_bytes = np.array([layer.tp_bytes for layer in layers])
        self.tp_count = np.array([layer.tp_collectives for layer in layers], dtype=float)
        self.matmuls = np.array([layer.matmuls for layer in layers], dtype=float)
        self.saved_max = _range_max(self.saved)
        self.kinds = {k.name: k for k in problem.kinds}
        self._tables = lru_cache(maxsize=None)(self._table)
        self._ranges = lru_cache(maxsize=None)(self._ranges_uncached)

    def table(self, cfg: StageConfig, b: int, in_flight: int) -> StageTable:
        return self._tables(cfg, b, in_flight)

    def capacity(self, kind: str) -> int:
        """Bytes a stage may use on each device: its memory less the reserve."""
        return int(self.kinds[kind].memory_bytes * (1 - self.problem.memory_reserve))

    def per_layer(self, cfg: StageConfig, b: int) -> PerLayer:
        """Each layer alone on one of these stages: the numbers every range sums, and
        what the planner's lower bounds take the least of."""
        kind = self.kinds[cfg.kind]
        per_device = b / cfg.dp  # examples each data-parallel slice runs
        speed = cfg.tp * self.matmul_rates(kind, cfg, per_device)
        tp_comm = self.tp_allreduce(kind, cfg.tp, self.tp_bytes * per_device, self.tp_count)  # forward; backward as much
        shard = per_device / cfg.tp  # activations split over tensor-parallel devices too (sequence parallel)
        return PerLayer(
            forward=self.fwd_flops * per_device / speed + tp_comm + kind.layer_overhead_s / 3,
            backward=(self.flops - self.fwd_flops) * per_device / speed + tp_comm + 2 * kind.layer_overhead_s / 3,
            state=self.params * self.problem.state_factor / cfg.tp,
            saved=self.saved * shard,
            inputs=self.inputs * shard,
        )

    def matmul_rates(self, kind: DeviceKind, cfg: StageConfig, per_device: float) -> np.ndarray:
        """FLOP/s of each layer's matmuls on one device of this stage: the size of one
        matmul (a forward's FLOPs on this device over its matmul count) sets the rate."""
        each = np.where(self.matmuls > 0, self.fwd_flops * per_device / cfg.tp / np.maximum(self.matmuls, 1.0), 0.0)
        return np.asarray(matmul_rate(kind.flops, each, kind.matmul_half_flops), dtype=float).reshape(self.n)

    def _table(self, cfg: StageConfig, b: int, in_flight: int) -> StageTable:
        f, bw, state, saved, kept_inputs, sync, tail = self._ranges(cfg, b)
        capacity = self.capacity(cfg.kind)
        kept = state + saved * in_flight
        kept_remat = state + kept_inputs * in_flight + self.saved_max * (b / cfg.dp / cfg.tp)
        force = self.problem.force_remat  # large runs recompute whether or not memory asks
        fits, fits_remat = kept <= capacity, (kept_remat <= capacity) & (self.problem.allow_remat or force)
        remat = fits_remat if force else ~fits & fits_remat
        ok = np.triu(remat | (fits & (not force)), k=1)
        forward = np.where(ok, f, INF)
        backward = np.where(ok, bw + np.where(remat, f, 0.0), INF)
        return StageTable(forward, backward, remat & ok, np.where(remat, kept_remat, kept), tail, sync, capacity)

    def _ranges_uncached(self, cfg: StageConfig, b: int) -> tuple[np.ndarray, ...]:
        """What does not depend on the stage's place in the pipeline: times, state,
        activations of one microbatch (kept whole, or only layer inputs under remat)."""
        p, kind = self.problem, self.kinds[cfg.kind]
        layer = self.per_layer(cfg, b)
        grads = _span(_cumsum(self.params)) / cfg.tp
        sync = self._sync(kind, cfg, grads)
        tail = sync + grads * p.optimizer_traffic / kind.memory_bandwidth
        return (_span(_cumsum(layer.forward)), _span(_cumsum(layer.backward)), _span(_cumsum(layer.state)),
                _span(_cumsum(layer.saved)), _span(_cumsum(layer.inputs)), sync, tail)

    def tp_allreduce(self, kind: DeviceKind, tp: int, nbytes: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Seconds of one pass's tensor-parallel all-reduces per layer: `count` sums
        sharing `nbytes` (Megatron: two per forward, two per backward, each once)."""
        if tp == 1:
            return np.zeros_like(nbytes)
        count = np.maximum(count, 1.0)
        return count * all_reduce_times(Topology(1, tp, kind.intra, kind.intra), nbytes / count)

    def _sync(self, kind: DeviceKind, cfg: StageConfig, grads: np.ndarray) -> np.ndarray:
        if cfg.dp == 1:
            return np.zeros_like(grads)
        per_node = max(1, kind.devices_per_node // cfg.tp)
        nodes = max(1, cfg.dp // per_node)
        return all_reduce_times(Topology(nodes, min(per_node, cfg.dp), kind.intra, kind.inter), grads)

    def sends(self, a: StageConfig, c: StageConfig, b: int) -> np.ndarray:
        """Seconds to move one microbatch's activation across a cut before layer j,
        from stage `a` to the next stage `c`: each data-parallel slice sends its part."""
        link = self.problem.link(a.kind, c.kind)
        streams = min(a.dp, c.dp)
        out = link.latency + self.inputs * b / streams / link.bandwidth
        return np.concatenate([out, [INF]])  # no cut after the last layer


def all_reduce_times(topo: Topology, nbytes: np.ndarray) -> np.ndarray:
    """The fastest all-reduce for every size in `nbytes` at once (0 for nothing)."""
    lines = affine_costs("all_reduce", topo)
    if not lines:
        return np.zeros_like(nbytes)
    times = np.min([a + slope * nbytes for a, slope in lines], axis=0)
    return np.where(nbytes > 0, times, 0.0)


def _cumsum(values: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(values)])


def in_flight(schedule: str, num_microbatches: int, position: int, num_stages: int, chunks: int = 1) -> int:
    """Microbatches whose activations stage `position` (of `num_stages`, virtual
    stages under an interleaved schedule) holds at once: the schedule's answer."""
    return schedules.get(schedule).in_flight(num_microbatches, position, num_stages, chunks)

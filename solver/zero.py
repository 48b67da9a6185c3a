"""ZeRO over a stage's data axis, priced: what each stage saves in memory per device
and what it costs in collectives, and the per-parameter choice between them.

A stage's data-parallel devices may each hold all of a parameter's state, or a
1/dp share of part of it (DeepSpeed's ZeRO stages; FSDP is stage 3):
  0  everything replicated; gradients all-reduced
  1  optimizer state sharded: each device updates its share, the new parameter is
     all-gathered once per step
  2  gradients too: reduce-scattered instead of all-reduced
  3  parameters too: all-gathered before the forward and again before the backward
     of every microbatch, and never gathered after the update
A replicated gradient is all-reduced once per step; a sharded accumulator takes every
microbatch's gradient reduce-scattered; the update's all-gather runs once per step
(`zero_time`). Pure numbers, no jax: the sharding pass's choice and the planner's
stage table both price ZeRO by `zero_time`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from solver.collectives import Topology, fastest_times
from solver.memory import ZERO_STAGES as STAGES, sharded_state



def _check(dp: int, zero: int) -> None:
    if zero not in STAGES:
        raise ValueError(f"zero is the ZeRO stage 0, 1, 2 or 3, got {zero!r}")
    if dp < 1:
        raise ValueError(f"dp is the data axis size, at least 1, got {dp!r}")


def state_bytes_per_device(param_bytes: float, opt_bytes: float, grad_bytes: float, dp: int, zero: int) -> float:
    """Bytes one device of a `dp`-wide data axis holds for parameters, optimizer state
    and gradients whose whole (per device without ZeRO: after any model-axis split)
    sizes are given, at ZeRO stage `zero`: `solver.memory`'s split, summed. A
    parameter's gathered copy during the forward or backward is activation-like
    (transient) and not counted here."""
    _check(dp, zero)
    held = sharded_state(param_bytes, grad_bytes, opt_bytes, dp, zero)
    return held.parameters + held.gradients + held.optimizer_state


@dataclass(frozen=True)
class ZeroTime:
    """Seconds of a stage's data-axis collectives at one ZeRO stage, by when they run
    (numbers, or numpy arrays of them for many parameter sets at once)."""

    forward: Any  # per microbatch, before its forward: ZeRO-3's all-gather of the parameters
    backward: Any  # per microbatch, in its backward: ZeRO-3's second all-gather; ZeRO-2/3's gradient reduce-scatter
    step: Any  # once per step: ZeRO-0/1's gradient all-reduce; ZeRO-1/2's all-gather of the updated parameters

    def per_step(self, microbatches: int) -> Any:
        return max(1, microbatches) * (self.forward + self.backward) + self.step


def zero_time(param_bytes: Any, grad_bytes: Any, zero: int, topology: Topology) -> ZeroTime:
    """The one price of ZeRO's collectives, which the planner's stage table and the
    sharding pass's per-parameter choice both ask: each collective at its fastest
    algorithm on `topology` (its size is the data axis), for parameters and gradients
    of these sizes per device before any data-axis split. A replicated gradient
    (ZeRO-0/1) is all-reduced once per step, after the microbatches accumulate it; a
    sharded accumulator (ZeRO-2/3) takes each microbatch's gradient reduce-scattered."""
    _check(max(topology.size, 1), zero)
    zeros = np.zeros_like(np.asarray(grad_bytes, dtype=float))
    gather = fastest_times("all_gather", topology, param_bytes) + zeros
    if zero <= 1:
        return ZeroTime(zeros, zeros, fastest_times("all_reduce", topology, grad_bytes) + (gather if zero == 1 else zeros))
    scatter = fastest_times("reduce_scatter", topology, grad_bytes) + zeros
    if zero == 2:
        return ZeroTime(zeros, scatter, gather)
    return ZeroTime(gather, gather + scatter, zeros)


def zero_comm_time(param_bytes: float, grad_bytes: float, dp: int, zero: int, topology: Topology,
                   microbatches: int = 1) -> float:
    """Seconds per step of the data axis's collectives for these parameters at ZeRO
    stage `zero` (`zero_time`, over `microbatches`)."""
    _check(dp, zero)
    if dp == 1:
        return 0.0
    return float(zero_time(param_bytes, grad_bytes, zero, topology).per_step(microbatches))


@dataclass(frozen=True)
class ZeroItem:
    """One parameter (or layer) as the choice sees it: whole sizes per device without
    ZeRO, and whether its layout leaves a dimension the data axis divides."""

    param_bytes: float
    opt_bytes: float
    grad_bytes: float
    shardable: bool = True


def choose_zero(items: Sequence[ZeroItem], dp: int, topology: Topology, microbatches: int = 1,
                budget_bytes: float | None = None, floor: int = 0) -> list[int]:
    """A ZeRO stage per item: every shardable item starts at `floor` (0: whole, the
    layout the runtime's programs were tuned with), then, while the items' state
    exceeds `budget_bytes` per device, takes the move up one stage that frees the most
    bytes per second of collectives it adds (a move that adds none first), as Alpa's
    ILP trades memory for communication. Where nothing fits, every shardable item
    ends at stage 3 (the caller's memory check names the shortfall)."""
    if floor not in STAGES:
        raise ValueError(f"floor is a ZeRO stage 0-3, got {floor!r}")
    if dp <= 1:
        return [0] * len(items)

    def cost(item: ZeroItem, z: int) -> float:
        return zero_comm_time(item.param_bytes, item.grad_bytes, dp, z, topology, microbatches)

    def held(item: ZeroItem, z: int) -> float:
        return state_bytes_per_device(item.param_bytes, item.opt_bytes, item.grad_bytes, dp, z)

    levels = [floor if it.shardable else 0 for it in items]
    if budget_bytes is None:
        return levels
    total = sum(held(it, z) for it, z in zip(items, levels))
    while total > budget_bytes:
        moves = []
        for k, (it, z) in enumerate(zip(items, levels)):
            if not it.shardable or z == 3:
                continue
            freed = held(it, z) - held(it, z + 1)
            if freed <= 0:
                continue
            extra = max(cost(it, z + 1) - cost(it, z), 0.0)
            moves.append((-(freed / extra) if extra > 0 else -float("inf"), -freed, k))
        if not moves:
            break
        _, _, k = min(moves)
        total -= held(items[k], levels[k]) - held(items[k], levels[k] + 1)
        levels[k] += 1
    return levels

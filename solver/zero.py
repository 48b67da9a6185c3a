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
hetpar's stage programs sync gradients inside every microbatch's backward (the
accumulator lives where the gradient lands), so the gradient collective is paid per
microbatch, the update's all-gather once per step. Pure numbers, no jax: the sharding
pass and the planner's memory model both call these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from solver.collectives import Topology, best
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


def zero_comm_time(param_bytes: float, grad_bytes: float, dp: int, zero: int, topology: Topology,
                   microbatches: int = 1) -> float:
    """Seconds per step of the data axis's collectives for these parameters at ZeRO
    stage `zero`, each collective at its best algorithm on `topology` (its size is
    the data axis): the gradient sync of every microbatch, plus the all-gathers the
    stage adds."""
    _check(dp, zero)
    if dp == 1:
        return 0.0
    m = max(1, microbatches)
    all_reduce = best("all_reduce", topology, grad_bytes)[1]
    reduce_scatter = best("reduce_scatter", topology, grad_bytes)[1]
    gather = best("all_gather", topology, param_bytes)[1]
    if zero == 0:
        return m * all_reduce
    if zero == 1:
        return m * all_reduce + gather
    if zero == 2:
        return m * reduce_scatter + gather
    return m * (reduce_scatter + 2 * gather)


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

"""A floor on every variant `mixed._resplit` could make of a candidate with a mixed
stage, before its positions' tables are built.

`best_mixed` prices a candidate only where the least its busiest position is busy a
step (`mixed._position`'s "least": each member's `m` forwards and backwards plus its
tail, under the ZeRO stage and recomputation its table picks among those that fit)
stays below the best variant so far, for the candidate as split and as split again.
Building those tables (each range's memory under every choice) is most of its cost,
and most candidates lose there. Memory only takes choices away, so the same least
over every choice, whether it fits or not, is no more than the tables' for any range,
and the split of the layers over the positions whose busiest such least is smallest
bounds both the candidate's split and `_resplit`'s: a candidate whose floor reaches
the best so far is refused unbuilt, as its tables would refuse it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from solver.cost.problem import Problem
from solver.cost.stage_costs import INF, StageConfig, StageCosts
from solver.planner.problem import PlanChoice, StageChoice


def stage_meshes(problem: Problem, s: StageChoice, b: int) -> list[StageConfig]:
    """A stage's devices as each mesh the search could give them at microbatches of `b`
    rows (tensor parallelism within a node, a data-parallel degree dividing the rows),
    its own first: a variant's coarser microbatches may suit another split better."""
    k = problem.kind(s.kind)
    own = StageConfig(s.kind, s.dp, s.tp)
    others = [StageConfig(s.kind, s.devices // t, t) for t in (1, 2, 4, 8)
              if t != s.tp and t <= min(problem.max_tp, k.devices_per_node) and s.devices % t == 0 and b % (s.devices // t) == 0]
    return [own, *others]


TRIAL = 8  # candidates every floor is tried on before it must earn its cost
YIELD = 4  # after them, floors are taken while at least one in this many refuses its candidate
_STATS = ("floor", "stats")  # the memo's entry: floors taken, candidates they refused


def refused(problem: Problem, choice: PlanChoice, costs: StageCosts, memo: dict, best_s: float) -> bool:
    """Whether `least_floor` proves no split of `choice` reaches below `best_s`. Where
    the floors of a widening (its `memo`) keep failing to refuse (memory, which they
    leave aside, is what rules on the largest models), they stop being taken: their
    cost would only add to the tables', and a False here only leaves the candidate to them."""
    return earning(memo, _STATS, lambda: least_floor(problem, choice, costs, memo) >= best_s)


def earning(memo: dict, stats: object, refuses: Callable[[], bool]) -> bool:
    """`refuses()`, while floors of its kind (`stats`, their entry in `memo`: floors
    taken, candidates refused) earn their cost: every one of the first `TRIAL`, then
    while at least one in `YIELD` refuses; False once they stop being taken."""
    taken = memo.setdefault(stats, [0, 0])
    if taken[0] >= TRIAL and taken[1] * YIELD < taken[0]:
        return False
    taken[0] += 1
    if refuses():
        taken[1] += 1
        return True
    return False


def least_floor(problem: Problem, choice: PlanChoice, costs: StageCosts, memo: dict | None = None) -> float:
    """No split of `choice`'s layers over its pipeline positions (its stages, a mixed
    stage's parts with their rows) has a busiest position whose `_position` least is
    below this. `memo`: positions' floors already computed, by what they depend on."""
    return split_floor(position_floors(problem, choice, costs, memo))


def position_floors(problem: Problem, choice: PlanChoice, costs: StageCosts, memo: dict | None = None) -> list[np.ndarray]:
    """Per pipeline position of `choice` (lead first), `_position_floor`'s, from `memo`
    where a candidate before this one had the position."""
    m = choice.num_microbatches
    b = choice.replica_batch[0] // m
    positions = members(choice)
    memo = {} if memo is None else memo
    out = []
    for p, mine in enumerate(positions):
        stages = tuple(choice.stages[k] for k in mine)
        last = p == len(positions) - 1
        key = ("floor", position_key(stages), b, m, last)
        if key not in memo:
            memo[key] = _position_floor(problem, costs, stages, b, m, last, memo)
        out.append(memo[key])
    return out


def members(choice: PlanChoice) -> list[list[int]]:
    """Per pipeline position, its stages' indices in `choice`: the lead, then its parts."""
    leads = [i for i, s in enumerate(choice.stages) if s.part_of < 0]
    return [[i, *(k for k, s in enumerate(choice.stages) if s.part_of == i)] for i in leads]


def position_key(stages: tuple[StageChoice, ...]) -> tuple:
    """What a pipeline position's floors and tables depend on of its stages (the lead, then
    its parts): their kind, mesh and rows, not their layers (the memo's key)."""
    return tuple((s.kind, s.dp, s.tp, s.examples) for s in stages)


def split_floor(floors: list[np.ndarray]) -> float:
    """The least over the splits of every layer over the positions (in order, each a
    range of at least one layer: `floors` are inf elsewhere) of the busiest one's figure."""
    best = None
    for least in floors:
        best = least[0].copy() if best is None else np.maximum(best[:, None], least).min(axis=0)
    return float(best[-1]) if best is not None else INF


def _position_floor(problem: Problem, costs: StageCosts, stages: tuple[StageChoice, ...], b: int, m: int,
                    last: bool, memo: dict | None = None) -> np.ndarray:
    """Per layer range [i, j) (inf unless i < j), at most `_position`'s least: a stage
    of its own, the least over its meshes (`stage_meshes`) and every (ZeRO stage,
    recomputation) of its table's step cost (`_least_step`); a mixed stage, over
    recomputations, its slowest part's least over ZeRO stages of `m` forwards and
    backwards plus the tail (`part_steps`, `mixed._part`'s figures).
    `memo`: parts' least already computed (candidates share many parts)."""
    memo = {} if memo is None else memo
    shape = (costs.n + 1, costs.n + 1)
    if len(stages) == 1:
        least = np.full(shape, INF)
        for cfg in stage_meshes(problem, stages[0], b):
            least = np.minimum(least, _least_step(costs, cfg, b, m, last))
        return np.where(costs.nonempty, least, INF)
    remats = ["full"] if problem.force_remat else [""] + (["full"] if problem.allow_remat else [])
    least = np.full(shape, INF)
    for remat in remats:
        slowest = np.zeros(shape)
        for s in stages:
            key = ("part floor", s.kind, s.dp, s.tp, s.examples or b, m, last, remat)
            if key not in memo:
                steps, _, _ = part_steps(costs, StageConfig(s.kind, s.dp, s.tp), s.examples or b, m, last, remat, memo)
                memo[key] = steps.min(axis=0)
            slowest = np.maximum(slowest, memo[key])
        least = np.minimum(least, slowest)
    return np.where(costs.nonempty, least, INF)


def _least_step(costs: StageCosts, cfg: StageConfig, b: int, m: int, last: bool) -> np.ndarray:
    """Per [i, j], the least over a stage table's (ZeRO stage, recomputation) choices of
    its step cost, memory aside: `m` forwards and backwards plus the tail, each choice's
    as `StageCosts._table_times` sums it, from the times its table then reads (the
    `_placed_times` cache, not a stack of every choice's figures)."""
    placed = last and bool(costs.measured(cfg, b / cfg.dp))  # as `_table_times` and `DeviceTables` place it
    least = None
    for zero, remat in costs.table_choices(cfg):
        forward, backward, tail, _, _ = costs._placed_times(cfg, b, zero, remat, placed)
        step = m * (forward + backward) + tail
        least = step if least is None else np.minimum(least, step)
    return np.broadcast_to(least, (costs.n + 1, costs.n + 1))


def part_steps(costs: StageCosts, cfg: StageConfig, rows: int, m: int, last: bool, remat: str,
               memo: dict | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mixed stage's part on `rows` of every microbatch, per ZeRO stage it may take
    (`costs.zero_stages` order), for every layer range, stacked: `m` forwards and
    backwards plus the tail (memory aside), a forward and backward, the tail (each
    `variant`'s times). `memo`: parts already priced (the floors and `mixed._part` share them)."""
    key = ("part steps", cfg, rows, m, last, remat)
    if memo is not None and key in memo:
        return memo[key]
    shape = (costs.n + 1, costs.n + 1)
    zeros = costs.zero_stages(cfg)
    steps, fbs, tails = np.empty((len(zeros), *shape)), np.empty((len(zeros), *shape)), np.empty((len(zeros), *shape))
    for z, zero in enumerate(zeros):
        forward, backward, tail, _, _ = costs._placed_times(cfg, rows, zero, remat, last)
        fbs[z], tails[z] = forward + backward, tail
        steps[z] = m * fbs[z] + tails[z]
    if memo is not None:
        memo[key] = steps, fbs, tails
    return steps, fbs, tails

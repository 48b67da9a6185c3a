"""3D tensor parallelism chosen, not only given: a stage whose model axis has four
or more devices may run them as two axes, `model` x `model2`, where a matmul can
split its rows, contraction and columns each on its own axis (Colossal-AI's 3D
matmul; `hetpar.shard.strategies`). Whether that is cheaper than one model axis
depends on the stage's matmuls (large square ones gain, narrow ones lose to the
extra gathers), so the sharding ILP decides: it solves the stage on the one-axis
mesh and on each factoring of its model axis, and the cheapest mesh (matmul time
plus collectives, as the ILP prices them) is the stage's, written into the plan.

A stage on two model axes also records the collectives its chosen layouts run
(`StagePlan.model_collectives`), which the estimator prices in place of its
Megatron estimate (`solver.cost.model_axes`), so its reported step time follows
those layouts.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import replace
from typing import Callable

from hetpar.plan import StagePlan
from hetpar.shard.strategies import AXES, StageProblem
from hetpar.trace.layers import Layers
from hetpar.trace.microbatch import Phase
from hetpar.trace.traced_step import TracedStep

log = logging.getLogger(__name__)

MIN_FACTORED = 4  # the smallest model axis that splits into two axes of at least 2


def factorings(model: int) -> list[tuple[int, int]]:
    """The ways to lay `model` devices out as two axes of at least 2 each, one of
    each unordered pair: the ILP prices both model axes over the same node link, so
    (a, b) and (b, a) cost the same."""
    return [(a, model // a) for a in range(2, model + 1) if model % a == 0 and 2 <= a <= model // a]


def choose_model_axes(shape: tuple[int, ...], cost_of: Callable[[dict[str, int], float], float]) -> tuple[tuple[int, ...], float]:
    """The cheapest of a `data` x `model` mesh of `shape` with a model axis of 4 or
    more and its factorings `data` x `a` x `b`, each priced by `cost_of(mesh, beat)`
    (the stage's ILP cost on a mesh: the caller solves each once and keeps it; it may
    answer any figure no less than `beat`, the cheapest so far, where it proves the
    mesh no cheaper), with its cost. A factored mesh must be strictly cheaper to be
    taken; any other shape stands."""
    shape = tuple(shape)
    if len(shape) != 2 or shape[1] < MIN_FACTORED:
        return shape, cost_of(dict(zip(AXES, shape)), math.inf)
    data, model = shape
    best, least = shape, cost_of(dict(zip(AXES, shape)), math.inf)
    for a, b in factorings(model):
        cost = cost_of(dict(zip(AXES, (data, a, b))), least)
        if cost < least:
            best, least = (data, a, b), cost
    return best, least


def with_model_axes(stage: StagePlan, cost_of: Callable[[dict[str, int], float], float]) -> StagePlan:
    """`stage` on the mesh `choose_model_axes` prices cheapest, its degrees kept."""
    shape = tuple(stage.mesh_shape)
    if len(shape) != 2 or shape[1] < MIN_FACTORED:
        return stage
    best, least = choose_model_axes(shape, cost_of)
    log.info("stage %d: %s mesh %s, its matmuls and collectives predicted at %.4g s", stage.index,
             "3-axis (3D tensor parallelism)" if len(best) == 3 else "2-axis", "x".join(map(str, best)), least)
    return replace(stage, mesh_shape=best)


def model_collectives(traced: TracedStep, layers: Layers, stage: StagePlan, problem: StageProblem,
                      choice: tuple[int, ...]) -> tuple[tuple[int, bool, str, int, float, float, int], ...]:
    """The collectives the ILP's solution `choice` runs, per microbatch, as
    `StagePlan.model_collectives` records them: each charged to its operator's layer
    and pass (forward, or backward with the update), its bytes per example where the
    value it moves carries examples (the ILP priced the whole traced batch), fixed
    where it does not (a weight or its gradient, moved once per microbatch). A weight
    gradient's sum over the data axis is left out: it is the data-parallel gradient
    reduction, which the estimator prices itself (once a step, over the nodes the
    data axis spans). The rest run, as the ILP priced them, over a node's link."""
    analysis, batch = traced.analysis, traced.batch_size
    counted: Counter = Counter()
    for op, value, (collective, axis, devices, nbytes) in problem.collectives(choice):
        if devices <= 1 or nbytes <= 0:
            continue
        if collective == "all_reduce" and axis == AXES[0] and value not in analysis.batch_axis:
            continue  # a weight gradient summed over the data axis: the gradient sync the estimator prices once a step
        layer = min(max(layers.op_layer.get(op, stage.layer_start), stage.layer_start), stage.layer_end - 1)
        backward = analysis.phase[op] is not Phase.MICRO or bool(analysis.backward[op])
        per_example = value in analysis.batch_axis
        counted[(layer, backward, collective, devices, 0.0 if per_example else float(nbytes),
                 float(nbytes) / batch if per_example else 0.0)] += 1
    return tuple(sorted((*key, count) for key, count in counted.items()))

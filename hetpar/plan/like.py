"""A plan for an eval or predict function that runs where a train step's parameters
already are (`hetpar.parallelize(eval_fn, like=train_step)`).

After a multi-stage step each parameter lives on the mesh of the stage that owns
it, laid out as that stage wants it. Re-planning the forward pass on its own would
cut it elsewhere and move parameters between meshes at every eval. Instead the eval
takes the training plan's stages as they are (devices, meshes) and runs each of its
operators on the stage where the parameters it reads already lie, in their current
layout: activations travel between stages, parameters stay put.
"""

from __future__ import annotations

from dataclasses import replace

import jax
from jax.sharding import NamedSharding

from hetpar.cluster.cluster import Cluster, jax_devices
from hetpar.trace.stages import place_once_ops
from hetpar.plan.model import Plan, Spec, runs
from hetpar.trace.fingerprint import signature
from hetpar.trace.layers import parameter_origins
from hetpar.trace.microbatch import Phase
from hetpar.trace.traced_step import TracedStep


def like_plan(traced: TracedStep, train: Plan, args: tuple, cluster: Cluster) -> tuple[Plan | None, Plan | None]:
    """What `parallelize(fn, like=train_step)` runs `traced` (fn's trace) with, as
    (a plan to use as it is, a placement to price): the train step's own plan when fn
    traces to the same program (the same step, or a re-trace of it: a plan binds to
    a step by its signature, the types and operators, not by which call traced it);
    for a forward-only function, the train plan's stages where its arguments lie
    (`placed_like`); otherwise neither, and the caller plans fn anew with the train
    step's cluster and options (a function with a backward of its own cannot borrow
    the train step's placement: its backward would run where its forward's
    parameters lie, out of the schedule's order)."""
    if train.program is not None and train.program == signature(traced.full):
        return train, None
    if any(traced.analysis.backward):
        return None, None
    return None, placed_like(traced, train, args, cluster)


def placed_like(traced: TracedStep, train: Plan, args: tuple, cluster: Cluster) -> Plan | None:
    """The training plan's stages running `traced` (the eval function) where its
    arguments lie; None when the training plan has data-parallel replicas or
    interleaved chunks (a parameter then has several homes) or no argument lies on
    one of its stages: the caller plans the function on its own."""
    if train.num_replicas != 1 or train.chunks != 1:
        return None
    home, specs = _homes(traced, train, args, cluster)
    if not home:
        return None
    graph, analysis = traced.full, traced.analysis
    origins = parameter_origins(graph, analysis)
    stage: list[int | None] = [None] * len(graph.ops)
    for op in graph.ops:
        if analysis.phase[op.index] is not Phase.MICRO:
            continue
        # Where its parameters are, and no earlier than what it reads: forward values
        # only flow to the same or later stages.
        wanted = [home[p] for v in op.inputs for p in origins.get(v, ()) if p in home]
        wanted += [stage[graph.producer[v]] for v in op.inputs
                   if v in graph.producer and stage[graph.producer[v]] is not None]
        stage[op.index] = max(wanted, default=0)
    stage_of_op = place_once_ops(graph, analysis, stage)
    # Stages past the last one that runs an operator (a head tied to the embedding
    # reads its weights on the first stage, leaving the last stage nothing) are not the
    # function's: it runs, and is priced, on those it uses.
    kept = max(stage_of_op, default=0) + 1
    stages = tuple(
        replace(s, shardings=tuple((v, spec) for v, spec in specs.items() if home[v] == s.index),
                operand_shardings=(), param_specs=())
        for s in train.stages[:kept]
    )
    notes = train.notes if kept == train.num_stages else (
        *train.notes, f"runs on {kept} of the step's {train.num_stages} stages: nothing it reads lies on the others")
    return replace(
        train, stages=stages, operator_stages=(runs(stage_of_op),), program=signature(graph),
        num_microbatches=traced.batch_size // traced.microbatch_size, replica_batch=(), notes=notes,
    )


def _homes(traced: TracedStep, train: Plan, args: tuple, cluster: Cluster) -> tuple[dict[int, int], dict[int, Spec]]:
    """Each batch-free argument lying on a stage's devices: that stage, and its layout
    there (a PartitionSpec as plain data)."""
    order = [d for g in cluster.groups for d in g.device_ids]
    devices = {frozenset(jax_devices(tuple(order[p] for p in s.device_ids))): s.index for s in train.stages}
    batch = set(traced.batch_invars)
    home: dict[int, int] = {}
    specs: dict[int, Spec] = {}
    for v, x in zip(traced.full.invars, jax.tree.leaves(args)):
        if v in batch or not isinstance(x, jax.Array):
            continue
        stage = devices.get(frozenset(x.sharding.device_set))
        if stage is None:
            continue
        home[v] = stage
        if isinstance(x.sharding, NamedSharding):
            spec = tuple(x.sharding.spec)
            specs[v] = spec + (None,) * (x.ndim - len(spec))
    return home, specs

"""ZeRO as layouts: a stage's chosen ZeRO stage written into its shardings.

In JAX, ZeRO is not a runtime feature but a choice of PartitionSpecs over the
stage's `data` axis, which compile then applies like any other sharding:
  1  each parameter's optimizer state (and the new state the step returns) gets the
     data axis on a dimension it divides: the update runs on shards and the new
     parameter is gathered back to its whole layout by XLA;
  2  the parameter's gradients too, so where the backward produces them they are
     reduce-scattered into the data-sharded accumulator instead of all-reduced;
  3  the parameter itself (and the new parameter the step returns, so it stays
     sharded between steps); `StagePlan.gathered` records its layout while in use,
     which the forward and backward programs gather it to where they read it.
A parameter's state is found from the update itself: walking back from the new
parameter the step returns, through the once-per-step update's values of the
parameter's shape, reaches its gradients (reductions) and optimizer state (step
inputs), whatever the optimizer. What is priced, and how the stage is chosen per
parameter, lives in `solver.zero`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetpar.trace.microbatch import Phase
from hetpar.trace.traced_step import TracedStep
from solver.zero import ZeroItem

DATA = "data"
ZERO = "zero"  # hybrid sharding: the in-node part of the data axis (StagePlan.zero_group; compile/layouts.py)
Spec = tuple[str | None, ...]


@dataclass
class ParamState:
    """One parameter of a stage and what the update keeps for it."""

    param: int  # value id of the step input
    new: int  # value id of the new parameter the step returns
    opt: list[int] = field(default_factory=list)  # optimizer state inputs of the same shape
    # Reductions the update reads, each with the dimension of it that is each of the
    # parameter's dimensions (a gradient may reach the update transposed).
    grads: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


def with_data(spec: Spec, shape: tuple[int, ...], dp: int, axis: str = DATA) -> Spec:
    """`spec` with the data axis (or `axis`: `zero`, its in-node part on a hybrid
    stage) on the largest dimension it leaves free that `dp` (that axis's size)
    divides (the first among equals); unchanged when the data axis is already used or
    no dimension takes it."""
    if DATA in spec or axis in spec:
        return spec
    free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % dp == 0 and shape[d] >= dp]
    if not free:
        return spec
    d = max(free, key=lambda d: (shape[d], -d))
    return tuple(axis if i == d else a for i, a in enumerate(spec))


def stage_params(traced: TracedStep, of_op: list[int], stage: int) -> list[ParamState]:
    """The parameters only this stage's forward/backward (or once-per-step work
    before them, such as a bias's broadcast) reads, each with the new
    value the step returns for it, its gradients and its optimizer state."""
    graph, analysis = traced.full, traced.analysis
    readers: dict[int, set[int]] = {}
    for op in graph.ops:
        if analysis.phase[op.index] is not Phase.POST:
            for v in op.inputs:
                readers.setdefault(v, set()).add(of_op[op.index])
    new_of = {old: new for new, old in zip(graph.outvars, graph.invars)
              if new not in graph.invars and getattr(graph.avals[new], "shape", None) == graph.avals[old].shape}
    out = []
    for v in graph.invars:
        if v in analysis.batch_axis or readers.get(v) != {stage} or v not in new_of or not graph.avals[v].shape:
            continue
        state = ParamState(v, new_of[v])
        shape = graph.avals[v].shape
        todo, seen = [(new_of[v], tuple(range(len(shape))))], set()
        while todo:
            u, dims = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            if u in analysis.reductions:
                state.grads.append((u, dims))
                continue
            producer = graph.producer.get(u)
            if producer is None:
                if u in graph.invars and u != v and u not in analysis.batch_axis and dims == tuple(range(len(shape))):
                    state.opt.append(u)
                continue
            op = graph.ops[producer]
            if analysis.phase[producer] is not Phase.POST:
                continue
            if op.name == "transpose":
                perm = op.params["permutation"]
                todo.append((op.inputs[0], tuple(perm[d] for d in dims)))
                continue
            if op.name in ("reshape", "broadcast_in_dim") and op.inputs[0] not in graph.constants:
                moved = _unit_dims(graph.avals[op.inputs[0]].shape, graph.avals[u].shape)
                if moved is not None and all(moved[d] is not None for d in dims):
                    todo.append((op.inputs[0], tuple(moved[d] for d in dims)))
                continue
            here = graph.avals[u].shape
            todo += [(w, dims) for w in op.inputs
                     if w not in graph.constants and getattr(graph.avals[w], "shape", None) == here]
        out.append(state)
    return out


def zero_items(traced: TracedStep, params: list[ParamState], specs: dict[int, Spec], mesh: dict[str, int],
               shards: int | None = None) -> list[ZeroItem]:
    """What `solver.zero` prices per parameter: whole bytes per device (after any
    model-axis split), and whether the data axis (`shards` of its devices: a hybrid
    stage's group) can shard it."""
    graph, dp = traced.full, shards or mesh.get(DATA, 1)

    def per_device(v: int) -> float:
        spec = specs.get(v, ())
        return graph.nbytes(v) / math.prod(mesh[a] for a in spec if a is not None)

    items = []
    for p in params:
        spec = specs.get(p.param) or (None,) * len(graph.avals[p.param].shape)
        shardable = DATA not in spec and with_data(spec, graph.avals[p.param].shape, dp) != spec
        grad = sum(per_device(g) for g, _ in p.grads) or per_device(p.param)
        items.append(ZeroItem(per_device(p.param), sum(per_device(o) for o in p.opt), grad, shardable))
    return items


def apply_zero(traced: TracedStep, params: list[ParamState], levels: list[int], specs: dict[int, Spec],
               dp: int, axis: str = DATA) -> tuple[dict[int, Spec], int, dict[int, Spec]]:
    """The stage's shardings with each parameter's ZeRO stage laid out, the stage's
    highest level, and (ZeRO-3) each sharded parameter's layout while in use. `axis`,
    `dp` wide: the data axis, or on a hybrid stage its in-node part `zero`, whose
    shards every replica across nodes holds alike."""
    graph = traced.full
    specs = dict(specs)
    gathered: dict[int, Spec] = {}
    top = 0

    def shard(v: int, base: Spec, dims: tuple[int, ...], axis_dim: int) -> None:
        """`v` (whose dimension dims[i] is the parameter's i) with the data axis where
        the sharded parameter has it, so the update pairs shards with shards; on
        another free dimension where its own layout takes that one."""
        spec = list(specs.get(v) or to_value(base, dims, len(graph.avals[v].shape)))
        if DATA in spec or axis in spec:
            return
        if spec[dims[axis_dim]] is None:
            spec[dims[axis_dim]] = axis
            specs[v] = tuple(spec)
        else:
            specs[v] = with_data(tuple(spec), graph.avals[v].shape, dp, axis)

    for p, level in zip(params, levels):
        shape = graph.avals[p.param].shape
        whole = specs.get(p.param) or (None,) * len(shape)
        sharded = with_data(whole, shape, dp, axis)
        if level == 0 or DATA in whole or axis in whole or sharded == whole:
            continue
        axis_dim = sharded.index(axis)
        same = tuple(range(len(shape)))
        for o in p.opt:
            shard(o, whole, same, axis_dim)
            for n, old in zip(graph.outvars, graph.invars):
                if old == o and o in specs:
                    specs[n] = specs[o]
        if level >= 2:
            for g, dims in p.grads:
                shard(g, whole, dims, axis_dim)
        if level == 3:
            specs[p.param] = specs[p.new] = sharded
            gathered[p.param] = whole
        top = max(top, level)
    return specs, top, gathered


def offloaded_state(traced: TracedStep, plan, stage) -> tuple[tuple[int, int], ...]:  # noqa: ANN001 (hetpar.plan types)
    """Host offload of `stage` (a StagePlan of `plan`): its parameters' optimizer state,
    found as ZeRO finds it (`stage_params`), each as (the state the step reads, the
    new state it returns in its place), the pairs the stage's programs keep in host
    memory between steps."""
    graph = traced.full
    params = stage_params(traced, plan.stage_of_operators(stage.replica), stage.lead)
    new_of = {old: new for new, old in zip(graph.outvars, graph.invars)
              if getattr(graph.avals[new], "shape", None) == graph.avals[old].shape}
    return tuple(sorted((o, new_of[o]) for p in params for o in p.opt if o in new_of and new_of[o] not in graph.invars))


def to_value(spec: Spec, dims: tuple[int, ...], ndim: int) -> Spec:
    """A parameter's layout carried to a value whose dimension dims[i] is its i."""
    out: list[str | None] = [None] * ndim
    for axis, d in zip(spec, dims):
        out[d] = axis
    return tuple(out)


def _unit_dims(before: tuple[int, ...], after: tuple[int, ...]) -> list[int | None] | None:
    """For a reshape that only adds or drops dimensions of size 1: each dimension of
    `after`, the dimension of `before` it is (None for an added unit); None for any
    other reshape."""
    if [n for n in before if n != 1] != [n for n in after if n != 1]:
        return None
    sources = iter(d for d, n in enumerate(before) if n != 1)
    return [next(sources) if n != 1 else None for n in after]

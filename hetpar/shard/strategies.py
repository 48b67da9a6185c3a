"""The JAX half of intra-operator sharding: the choices of a stage's matmuls on its
mesh, priced, as an `IntraOpProblem` for `solver.intra_op`.

A stage mesh has two axes, `data` and `model` (nodes x devices per node, or any
split), or three with a second model axis `model2` (3D tensor parallelism). Every
`dot_general` of the stage is a node. Its strategies map each mesh
axis to one of its dimensions (a batch dimension of the dot, a free dimension of
either operand, or the contracted dimension) or to none (replicated along that
axis): splitting the first operand's free dimension of an MLP over `data` is data
parallelism, splitting a weight's output columns over `model` and the next weight's
rows is Megatron's split. A contracted dimension split over an axis leaves partial
sums, so the strategy pays an all-reduce. On three axes a matmul may use all of
them at once, as Colossal-AI's 3D matmul does: one splits the rows, one the
contraction, one the columns, so each operand is split over a pair of axes and the
work over all three, and only the contraction's axis sums partials; whether that
beats a split over one or two axes (the others left replicating) is the ILP's
price to settle, matmul by matmul. Elementwise chains between matmuls follow
their producer, so an edge joins a matmul to the next one its result reaches, and a
layout change on the way costs an all-gather. Weights are sharded as the first
matmul that reads them wants, and the matmul that makes a weight's gradient pays to
bring it to that layout for the optimizer's update; the memory constraint keeps
every device's share of the weights within its budget.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable

from hetpar.trace.opgraph import OpGraph
from solver.collectives import LinkCost, Topology, best
from solver.efficiency import matmul_time
from solver.intra_op import Edge, IntraOpProblem, Node, Strategy

AXES = ("data", "model", "model2")  # a stage mesh's axes, in order; `model2` only on a 3-axis mesh
_LETTERS = {"data": "D", "model": "M", "model2": "N"}
MAX_HOPS = 6  # elementwise operators walked back from a matmul's operand
UPDATE_HOPS = 24  # ... and from a new parameter back to its gradient, through an optimizer's update
Spec = tuple[str | None, ...]  # one mesh axis (or None) per dimension of a value


@dataclass(frozen=True)
class DotChoice:
    lhs: Spec
    rhs: Spec
    out: Spec
    summed_over: tuple[str, ...]  # axes that split the contraction: partial sums to all-reduce


Step = tuple[str, str, int, float]  # one collective: its name, the mesh axis it runs over, that axis's devices, each one's bytes


@dataclass(frozen=True)
class Move:
    """What a node or an edge of the problem moves under a choice of every node's
    strategy: the operator it is charged to, the value it moves (for whether its
    bytes grow with the examples) and the collectives (`Step`s) the ILP priced."""

    op: int
    value: int
    steps: Callable[[tuple[int, ...]], list[Step]]


@dataclass(frozen=True)
class StageProblem:
    problem: IntraOpProblem
    dots: tuple[int, ...]  # op index per node
    choices: tuple[tuple[DotChoice, ...], ...]  # per node, per strategy
    weights: dict[int, tuple[int, int, tuple[int, ...]]]  # weight -> (node, operand, its dims in the operand) of its first reader
    moves: tuple[Move, ...] = ()  # every node's partial sums and every edge's resharding

    def collectives(self, choice: tuple[int, ...]) -> list[tuple[int, int, Step]]:
        """The collectives the solution `choice` runs, as the ILP priced them: (the
        operator each is charged to, the value it moves, the collective)."""
        return [(m.op, m.value, step) for m in self.moves for step in m.steps(choice)]


def dot_choices(op: Any, avals: list[Any], mesh: dict[str, int], examples: tuple[int | None, int | None] = (None, None)) -> list[DotChoice]:
    """Every way to place the mesh axes on this dot's dimensions (each axis on at
    most one role, each role at most one axis, sizes dividing evenly). Either axis
    may split anything, the examples or a weight (what ZeRO-style sharding over the
    `data` axis needs). Axis-swapped neighbours, (data, model) then (model, data),
    are correct because the stage programs pin every dot's operands to the chosen
    layout (see `hetpar.compile.programs`); `examples` (the batch dimension of each
    operand) restricts the data axis only on a mesh without a model axis."""
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = (avals[v].shape for v in op.inputs)
    l_free = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    r_free = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    roles = [("batch", i) for i in range(len(lb))] + [("lhs", d) for d in l_free] + [("rhs", d) for d in r_free]
    roles += [("contract", i) for i in range(len(lc))]
    axes = [a for a in AXES if mesh.get(a, 1) > 1]

    def splits_examples(role: tuple[str, int]) -> bool:
        kind, i = role
        if kind == "batch":
            dims = (lb[i], rb[i])
        elif kind == "contract":
            dims = (lc[i], rc[i])
        else:
            dims = (i, None) if kind == "lhs" else (None, i)
        return any(d is not None and d == e for d, e in zip(dims, examples))

    # A stage without a model axis runs as plain data parallelism (its programs get
    # no shardings, see `hetpar.shard.stage_specs`), so there its data axis is priced
    # as that: splitting examples only.
    free = tensor_parallel(mesh)
    options = [[None, *(r for r in roles if free or splits_examples(r))] for _ in axes]
    out = []
    for picks in itertools.product(*options):
        used = [p for p in picks if p is not None]
        if len(used) != len(set(used)):
            continue
        l_spec, r_spec = [None] * len(lhs), [None] * len(rhs)
        o_spec = [None] * (len(lb) + len(l_free) + len(r_free))
        summed = []
        ok = True
        for axis, role in zip(axes, picks):
            if role is None:
                continue
            kind, i = role
            if kind == "batch":
                dims = [(l_spec, lb[i], lhs), (r_spec, rb[i], rhs), (o_spec, i, None)]
            elif kind == "lhs":
                dims = [(l_spec, i, lhs), (o_spec, len(lb) + l_free.index(i), None)]
            elif kind == "rhs":
                dims = [(r_spec, i, rhs), (o_spec, len(lb) + len(l_free) + r_free.index(i), None)]
            else:
                dims = [(l_spec, lc[i], lhs), (r_spec, rc[i], rhs)]
                summed.append(axis)
            for spec, d, shape in dims:
                if shape is not None and shape[d] % mesh[axis]:
                    ok = False
                spec[d] = axis
        if ok:
            out.append(DotChoice(tuple(l_spec), tuple(r_spec), tuple(o_spec), tuple(summed)))
    return out


def tensor_parallel(mesh: dict[str, int]) -> bool:
    """Whether the mesh has a model axis of more than one device (any but `data`)."""
    return any(size > 1 for axis, size in mesh.items() if axis != AXES[0])


def _shards(spec: Spec, mesh: dict[str, int]) -> int:
    return math.prod(mesh[a] for a in spec if a is not None)


def _sources(graph: OpGraph, value: int, max_hops: int = MAX_HOPS) -> list[tuple[int, tuple[int, ...]]]:
    """Through elementwise work and transposes, to where a value really comes from:
    each (source value, for every dimension of `value` the source dimension it is).
    An elementwise operator with several inputs of the value's shape has several; the
    walk stops after a few operators, so a residual stream links a matmul to its
    neighbours rather than to every block before it."""
    out, todo, seen = [], [(value, tuple(range(len(graph.avals[value].shape))), 0)], set()
    while todo:
        v, dims, hops = todo.pop(0)
        if v in seen:
            continue
        seen.add(v)
        op = graph.ops[graph.producer[v]] if v in graph.producer else None
        if op is not None and op.name == "transpose":
            perm = op.params["permutation"]
            todo.append((op.inputs[0], tuple(perm[d] for d in dims), hops + 1))
            continue
        shape = graph.avals[v].shape
        same = [] if op is None or op.name == "dot_general" or len(op.outputs) != 1 else [
            u for u in op.inputs if u not in graph.constants and getattr(graph.avals[u], "shape", None) == shape]
        if same and hops < max_hops:
            todo += [(u, dims, hops + 1) for u in same]
        elif not same:
            out.append((v, dims))
    return out


def to_source(spec: Spec, dims: tuple[int, ...]) -> Spec:
    out: list[str | None] = [None] * len(spec)
    for axis, d in zip(spec, dims):
        out[d] = axis
    return tuple(out)


def stage_problem(
    graph: OpGraph, op_indices: list[int], batch_free_inputs: set[int], mesh: dict[str, int],
    flops_per_s: float, link: LinkCost, memory_budget: int | None = None, state_factor: float = 4.0,
    batch_axis: dict[int, int] | None = None, op_layer: dict[int, int] | None = None,
    data_state_factor: float | None = None, matmul_half_flops: float = 0.0,
) -> StageProblem | None:
    """The sharding problem of one stage's operators on a `data` x `model` mesh
    (None when the stage has no matmul to shard). With `op_layer` (operator -> layer),
    the matmuls of identical layers are tied: one layer's choices are solved and
    every copy of it takes them.

    A matmul's share on each device runs at the rate `solver.efficiency` gives its
    size, from the device's sustained `flops_per_s` and `matmul_half_flops` (0: the
    flat `flops_per_s`), as the planner prices it: splitting a matmul makes each
    device's piece smaller and slower per FLOP.

    Each weight byte a device holds is charged `state_factor` bytes of state
    (parameter, gradient, optimizer state, as the stage's ZeRO stage shards them over
    the data axis), except under a layout that already splits the weight over the
    data axis: ZeRO has no axis left to shard it over (`hetpar.shard.zero`), so such a
    weight is charged `data_state_factor` (the replicated state's, default
    `state_factor`). Charging it the ZeRO figure let the ILP pick layouts whose
    optimizer state placement then found whole, over the stage's memory."""
    data_state_factor = state_factor if data_state_factor is None else data_state_factor
    dots = [i for i in op_indices if graph.ops[i].name == "dot_general"]
    if not dots:
        return None
    batch_axis = batch_axis or {}
    position = {i: n for n, i in enumerate(dots)}
    nodes, choices, weights, moves = [], [], {}, []
    # A stage of identical blocks asks the same questions once per block: a dot's
    # choices and priced strategies depend only on its shapes (and which of its
    # operands are weights first read there), and an edge's table only on its two
    # ends' choices and the bytes crossing it. Each is computed once per pass.
    options_of: dict[tuple, tuple[DotChoice, ...]] = {}
    strategies_of: dict[tuple, tuple[Strategy, ...]] = {}
    tables: dict[tuple, tuple[tuple[float, ...], ...]] = {}
    for n, i in enumerate(dots):
        op = graph.ops[i]
        examples = tuple(batch_axis.get(v) for v in op.inputs)
        lhs, rhs = (graph.avals[v].shape for v in op.inputs)
        shape_key = (repr(op.params["dimension_numbers"]), tuple(lhs), tuple(rhs), examples)
        if shape_key not in options_of:
            options_of[shape_key] = tuple(dot_choices(op, graph.avals, mesh, examples))
        options = options_of[shape_key]
        (lc, _), _ = op.params["dimension_numbers"]
        flops = 2 * math.prod(graph.avals[op.outputs[0]].shape) * math.prod(lhs[d] for d in lc)
        out_bytes = graph.nbytes(op.outputs[0])
        for pos, v in enumerate(op.inputs):
            for source, dims in _sources(graph, v):
                if source in batch_free_inputs:
                    weights.setdefault(source, (n, pos, dims))
        held_here = tuple(sorted((pos, graph.nbytes(w)) for w, (node, pos, _) in weights.items() if node == n))
        key = (shape_key, out_bytes, held_here)
        if key not in strategies_of:
            strategies = []
            for c in options:
                devices = _shards(c.lhs, mesh) * _shards(tuple(a for a in c.rhs if a not in c.lhs), mesh)
                comm = _steps_s(_sum_steps(c, out_bytes, mesh), link)
                held = sum((data_state_factor if AXES[0] in (c.lhs, c.rhs)[pos] else state_factor) * nbytes
                           / _shards((c.lhs, c.rhs)[pos], mesh) for pos, nbytes in held_here)
                each = flops / devices
                strategies.append(Strategy(_describe(c), matmul_time(each, each, flops_per_s, matmul_half_flops), comm,
                                           int(held)))
            strategies_of[key] = tuple(strategies)
        nodes.append(Node(f"{op.scope}/dot_general#{i}", strategies_of[key]))
        choices.append(options)  # shared by identical dots: edge tables are cached by its identity
        moves.append(Move(i, op.outputs[0], lambda ch, n=n, b=out_bytes: _sum_steps(choices[n][ch[n]], b, mesh)))
    edges = []
    for n, i in enumerate(dots):
        for pos, v in enumerate(graph.ops[i].inputs):
            nbytes = graph.nbytes(v)
            for source, dims in _sources(graph, v):
                producer = graph.producer.get(source)
                if producer in position:  # a matmul's result, on the way to this one
                    src, have, how = position[producer], lambda a: a.out, ("out",)
                elif source in weights and weights[source][:2] != (n, pos):  # a weight laid out for its first reader
                    src, first_pos, first_dims = weights[source]
                    have = lambda a, p=first_pos, d=first_dims: to_source((a.lhs, a.rhs)[p], d)  # noqa: E731
                    how = ("weight", first_pos, first_dims)
                else:
                    continue
                if src == n:
                    continue
                key = (id(choices[src]), id(choices[n]), how, pos, dims, nbytes)
                if key not in tables:
                    tables[key] = _reshard_table([have(a) for a in choices[src]],
                                                 [to_source((b.lhs, b.rhs)[pos], dims) for b in choices[n]], nbytes, mesh, link)
                edges.append(Edge(src, n, tables[key]))
                moves.append(Move(i, v, lambda ch, s=src, n=n, h=have, p=pos, d=dims, b=nbytes: _reshard_steps(
                    h(choices[s][ch[s]]), to_source((choices[n][ch[n]].lhs, choices[n][ch[n]].rhs)[p], d), b, mesh)))
    edges += _update_edges(graph, position, choices, weights, mesh, link, moves, dots)
    holders = tuple(sorted({node for node, _, _ in weights.values()}))
    same_as = _same_as(graph, dots, weights, batch_axis, op_layer) if op_layer else ()
    return StageProblem(
        IntraOpProblem(tuple(nodes), tuple(edges), memory_budget, (holders,) if memory_budget is not None and holders else (),
                       same_as),
        tuple(dots), tuple(choices), weights, tuple(moves),
    )


def _update_edges(graph: OpGraph, position: dict[int, int], choices: list, weights: dict, mesh: dict[str, int],
                  link: LinkCost, moves: list[Move], dots: list[int]) -> list[Edge]:
    """The optimizer update reads a weight's gradient where the weight lies, so the
    matmul that makes the gradient pays to bring it into the weight's layout (a
    gradient split over an axis the weight is not split over must be gathered). The
    step returns each new parameter where its old one came in."""
    edges = []
    tables: dict[tuple, tuple[tuple[float, ...], ...]] = {}  # identical blocks share their tables
    for new, old in zip(graph.outvars, graph.invars):
        if old not in weights or getattr(graph.avals[new], "shape", None) != graph.avals[old].shape:
            continue
        reader, pos, dims = weights[old]
        for source, path in _sources(graph, new, UPDATE_HOPS):
            maker = position.get(graph.producer.get(source))
            if maker is None or maker == reader:
                continue
            nbytes = graph.nbytes(source)
            key = (id(choices[maker]), id(choices[reader]), pos, dims, path, nbytes)
            if key not in tables:
                lies = [to_source(to_source((c.lhs, c.rhs)[pos], dims), path) for c in choices[reader]]
                tables[key] = _reshard_table([a.out for a in choices[maker]], lies, nbytes, mesh, link)
            edges.append(Edge(maker, reader, tables[key]))
            moves.append(Move(dots[maker], source, lambda ch, a=maker, r=reader, p=pos, d=dims, t=path, b=nbytes: _reshard_steps(
                choices[a][ch[a]].out, to_source(to_source((choices[r][ch[r]].lhs, choices[r][ch[r]].rhs)[p], d), t), b, mesh)))
    return edges


def _same_as(graph: OpGraph, dots: list[int], weights: dict, batch_axis: dict[int, int], op_layer: dict[int, int]) -> tuple[int, ...]:
    """Node -> the node it copies: the matmul at the same place in the first layer
    whose matmuls are the same (shapes, contraction, example axes, weights first read
    there). Layers that differ (the embedding's, the head's) stay free."""
    held: dict[int, list] = {}
    for w, (node, pos, dims) in weights.items():
        held.setdefault(node, []).append((pos, dims, graph.avals[w].shape))
    by_layer: dict[int, list[int]] = {}
    for n, i in enumerate(dots):
        if i in op_layer:
            by_layer.setdefault(op_layer[i], []).append(n)

    def signature(n: int) -> tuple:
        op = graph.ops[dots[n]]
        ins = tuple((graph.avals[v].shape, str(graph.avals[v].dtype), batch_axis.get(v)) for v in op.inputs)
        return repr(op.params["dimension_numbers"]), ins, tuple(sorted(held.get(n, ())))

    same_as = list(range(len(dots)))
    first: dict[tuple, list[int]] = {}
    for layer in sorted(by_layer):
        members = by_layer[layer]
        leader = first.setdefault(tuple(signature(n) for n in members), members)
        for n, r in zip(members, leader):
            same_as[n] = r
    return tuple(same_as)


def _reshard_table(haves: list[Spec], wants: list[Spec], nbytes: int, mesh: dict[str, int],
                   link: LinkCost) -> tuple[tuple[float, ...], ...]:
    """An edge's seconds for each producer layout (row) and consumer layout (column):
    many strategies share a layout (more so on three axes), so each distinct pair is
    priced once."""
    priced: dict[tuple[Spec, Spec], float] = {}
    for have in set(haves):
        for want in set(wants):
            priced[have, want] = _reshard_s(have, want, nbytes, mesh, link)
    return tuple(tuple(priced[have, want] for want in wants) for have in haves)


def _reshard_s(have: Spec, want: Spec, nbytes: int, mesh: dict[str, int], link: LinkCost) -> float:
    return _steps_s(_reshard_steps(have, want, nbytes, mesh), link)


def _reshard_steps(have: Spec, want: Spec, nbytes: int, mesh: dict[str, int]) -> list[Step]:
    """Gathering every axis the producer split on that the consumer does not want on
    the same dimension; a split the consumer adds is a local slice (free)."""
    steps, size = [], nbytes / _shards(have, mesh)
    for d, axis in enumerate(have):
        if axis is not None and want[d] != axis:
            steps.append(("all_gather", axis, mesh[axis], size * mesh[axis]))
            size *= mesh[axis]
    return steps


def _sum_steps(c: DotChoice, out_bytes: int, mesh: dict[str, int]) -> list[Step]:
    """A matmul's partial sums, all-reduced over each axis that split its contraction."""
    return [("all_reduce", a, mesh[a], out_bytes / _shards(c.out, mesh)) for a in c.summed_over]


def _steps_s(steps: list[Step], link: LinkCost) -> float:
    """Seconds of these collectives, each over one axis of a node's devices, as the
    registry's fastest algorithm runs it (what the estimator charges them too)."""
    return sum(best(name, Topology(1, devices, link, link), nbytes)[1] for name, _, devices, nbytes in steps)


def _describe(c: DotChoice) -> str:
    fmt = lambda spec: "".join("R" if a is None else _LETTERS[a] for a in spec)  # noqa: E731
    return f"{fmt(c.lhs)} x {fmt(c.rhs)} -> {fmt(c.out)}" + (f" (sum over {', '.join(c.summed_over)})" if c.summed_over else "")

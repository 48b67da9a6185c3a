"""Layer construction: cut the forward pass into layers, then give every backward
operator the layer of the forward work it differentiates.

Cuts go where few bytes cross (the residual stream between transformer blocks, not
the wide activations inside one) and where flax module scopes change, so that asking
a GPT with N blocks for N layers cuts at block boundaries. Where the model repeats a
block (found by structure at any module depth, `hetpar.trace.blocks`), the block
boundaries are the cuts: one layer per block plus the embedding and the head, and
finer layers only inside blocks. Layer cost counts the
forward operators and the backward operators attached to them, so layers are
balanced by the work they really carry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hetpar.errors import PlanError
from hetpar.trace.blocks import Structure, find_blocks, op_signature
from hetpar.trace.flops import MATMUL_OPS
from hetpar.trace.fusion import FUSED_INTO_READERS
from hetpar.trace.microbatch import MicrobatchAnalysis, Phase
from hetpar.trace.opgraph import OpGraph
from solver.partition import min_max_cuts

_MAX_CUT_BYTES_FACTOR = 2.0  # cut candidates carry at most this times the cheapest cut


@dataclass
class Layers:
    op_layer: dict[int, int]  # MICRO op index -> layer
    num_layers: int
    flops: list[float]  # per layer: forward + backward FLOPs for the full batch
    names: list[str]  # per layer: the module scopes it spans, for people
    boundary_bytes: list[int]  # bytes entering each layer from earlier ones (forward)
    forward_flops: list[float] = field(default_factory=list)  # per layer: the forward part of `flops`
    param_bytes: list[int] = field(default_factory=list)  # per layer: batch-free step inputs its forward reads
    saved_bytes: list[int] = field(default_factory=list)  # per layer, full batch: forward values its backward reads
    tp_bytes: list[int] = field(default_factory=list)  # per layer, full batch: all-reduced per forward if split Megatron's way
    tp_count: list[int] = field(default_factory=list)  # per layer: how many all-reduces carry `tp_bytes` (as many in the backward)
    largest_bytes: list[int] = field(default_factory=list)  # per layer, full batch: its largest per-example value
    # per layer: the part of `param_bytes` no matmul reads (an embedding table, a norm's scale), which the
    # sharding pass leaves whole on the model axis, so tensor parallelism does not split it
    unsplit_param_bytes: list[int] = field(default_factory=list)
    # per layer, full batch: what of `saved_bytes` a backward that reruns the forward in its own program
    # holds (the rest XLA fuses into the operators that read it)
    recomputed_bytes: list[int] = field(default_factory=list)
    # per layer: matmul kernels (dot_general, convolution) in its forward and in its backward. With the
    # FLOPs they carry, a count is all the efficiency curve needs (solver.efficiency: a matmul of F FLOPs
    # takes (F + F_half) / sustained seconds, so a layer's matmuls take (their FLOPs + count x F_half) /
    # sustained whatever their sizes): the planner prices them as the predictor prices each traced matmul.
    matmuls: list[int] = field(default_factory=list)
    backward_matmuls: list[int] = field(default_factory=list)
    # per layer, full batch: what its backward holds at once beyond `recomputed_bytes` when it reruns the forward
    # (cotangents and the backward's own temporaries, from a liveness walk over its operators)
    rerun_working_bytes: list[int] = field(default_factory=list)


def build_layers(graph: OpGraph, analysis: MicrobatchAnalysis, op_flops: list[float], num_layers: int) -> Layers:
    forward = _forward(graph, analysis)
    backward = [op.index for op in graph.ops if analysis.phase[op.index] is Phase.MICRO and analysis.backward[op.index]]
    if not forward:
        raise PlanError("the step has no per-example forward computation to split into layers")
    if num_layers > len(forward):
        raise PlanError(
            f"cannot cut the forward pass into {num_layers} layers: it has only {len(forward)} operators; "
            f"ask for at most {len(forward)} layers (and stages)"
        )

    position = {op: i for i, op in enumerate(forward)}
    fwd_flops = [op_flops[i] for i in forward]
    crossing = _crossing_bytes(graph, forward, position)
    structure = forward_structure(graph, analysis, forward, fwd_flops, crossing)
    paths = [graph.ops[i].module_path for i in forward]
    if structure is not None:
        # Blocks found by structure: cut between them (and, for more layers than
        # pieces, inside them too, every block boundary staying a cut).
        depth = structure.depth if num_layers <= structure.pieces else max(len(p) for p in paths)
        keys = [p[:depth] for p in paths] if depth else [()] * len(forward)
    else:
        depth = _scope_depth(graph, forward, fwd_flops, num_layers)
        keys = [p[:depth] for p in paths] if depth else [()] * len(forward)

    # Attach backward ops to forward positions (by scope, else structurally) for cost.
    anchor = _backward_anchors(graph, forward, backward, keys, depth, position)
    costs = np.array(fwd_flops, dtype=float)
    for op, pos in anchor.items():
        costs[pos] += op_flops[op]

    if structure is not None:
        cuts, names = _structured_cuts(structure, paths, costs, crossing, num_layers)
    else:
        if depth:
            candidates = [i for i in range(1, len(forward)) if keys[i] != keys[i - 1]]
        else:
            candidates = list(range(1, len(forward)))
        candidates = _cheap(candidates, crossing, costs, num_layers)
        cuts = min_max_cuts(costs, candidates, num_layers, cut_costs=crossing)
        # Named by the scopes cut at, or (cut anywhere) by the full module paths.
        label = keys if depth else paths
        names = [_describe(label[s:e]) for s, e in zip([0] + cuts, cuts + [len(forward)])]
    fwd_layer = np.searchsorted(np.array(cuts), np.arange(len(forward)), side="right")

    op_layer = {op: int(fwd_layer[i]) for i, op in enumerate(forward)}
    for op in backward:  # in program order: producers before consumers
        layer = int(fwd_layer[anchor[op]])
        for v in graph.ops[op].inputs:
            p = graph.producer.get(v)
            if p is not None and analysis.phase[p] is Phase.MICRO and analysis.backward[p]:
                layer = min(layer, op_layer[p])  # cotangents only flow to earlier layers
        op_layer[op] = layer

    flops = [0.0] * num_layers
    forward_flops = [0.0] * num_layers
    for op, layer in op_layer.items():
        flops[layer] += op_flops[op]
        if not analysis.backward[op]:
            forward_flops[layer] += op_flops[op]
    boundary = [0] + [int(crossing[c]) for c in cuts]
    return Layers(
        op_layer, num_layers, flops, names, boundary, forward_flops,
        _param_bytes(graph, analysis, op_layer, num_layers), _saved_bytes(graph, analysis, op_layer, num_layers),
        *_tp_bytes(graph, analysis, op_layer, num_layers), _largest_bytes(graph, analysis, op_layer, num_layers),
        _param_bytes(graph, analysis, op_layer, num_layers, unsplit=True),
        _recomputed_bytes(graph, analysis, op_layer, num_layers),
        *_matmul_counts(graph, analysis, op_layer, op_flops, num_layers),
        _rerun_working_bytes(graph, analysis, op_layer, num_layers),
    )


def block_count(graph: OpGraph, analysis: MicrobatchAnalysis, op_flops: list[float]) -> int:
    """How many layers the model's own structure asks for: one per repeated block,
    at whatever depth the blocks sit (`hetpar.trace.blocks`), plus what comes before
    and after them (the embedding, the head). Without repeated blocks: the
    substantial pieces at the model's first module level (each at least a quarter of
    the largest piece's work). The planner wants at least one layer per block, so
    that a faster kind of device can take any number of blocks."""
    forward = _forward(graph, analysis)
    if not forward:
        return 1
    structure = structure_of(graph, analysis, op_flops)
    if structure is not None:
        return structure.pieces
    segments: list[float] = []
    previous = None
    for op, f in zip(forward, [op_flops[i] for i in forward]):
        key = graph.ops[op].module_path[:2]
        if key != previous:
            segments.append(0.0)
            previous = key
        segments[-1] += f
    if not segments or max(segments) <= 0:
        return 1
    return sum(f >= 0.25 * max(segments) for f in segments)


def structure_of(graph: OpGraph, analysis: MicrobatchAnalysis, op_flops: list[float]) -> Structure | None:
    """The step's forward pass as embedding, repeated blocks and head (`hetpar.trace.blocks`)."""
    forward = _forward(graph, analysis)
    if not forward:
        return None
    crossing = _crossing_bytes(graph, forward, {op: i for i, op in enumerate(forward)})
    return forward_structure(graph, analysis, forward, [op_flops[i] for i in forward], crossing)


def _forward(graph: OpGraph, analysis: MicrobatchAnalysis) -> list[int]:
    return [op.index for op in graph.ops if analysis.phase[op.index] is Phase.MICRO and not analysis.backward[op.index]]


def forward_structure(graph: OpGraph, analysis: MicrobatchAnalysis, forward: list[int], fwd_flops: list[float],
                      crossing: np.ndarray) -> Structure | None:
    """The forward pass as embedding, repeated blocks and head (`find_blocks`), or
    None when no block repeats. Cached on the graph: the layers pass asks for it once
    per layer count it tries."""
    key = ("structure", tuple(forward))
    if key not in graph._cache:
        origins = parameter_origins(graph, analysis)
        ops = [graph.ops[i] for i in forward]
        graph._cache[key] = find_blocks(
            [op.module_path for op in ops],
            [op_signature(op.name, [graph.avals[v] for v in op.inputs], [graph.avals[v] for v in op.outputs]) for op in ops],
            fwd_flops, crossing, [any(v in origins for v in op.inputs) for op in ops])
    return graph._cache[key]


def _structured_cuts(structure: Structure, paths: list[tuple[str, ...]], costs: np.ndarray, crossing: np.ndarray,
                     num_layers: int) -> tuple[list[int], list[str]]:
    """Cuts and layer names for a forward pass with repeated blocks. At most as many
    layers as pieces: cuts only between pieces (neighbouring pieces grouped, balanced
    by work). More: every piece whole first, then the pieces with the most work per
    layer cut again inside, where their module scopes change and few bytes cross, so
    every block boundary stays a cut."""
    bounds = list(structure.starts) + [len(paths)]
    labels = structure.labels
    if num_layers <= structure.pieces:
        cuts = min_max_cuts(costs, list(structure.starts[1:]), num_layers, cut_costs=crossing) if num_layers > 1 else []
        index = {start: i for i, start in enumerate(structure.starts)}
        names = []
        for lo, hi in zip([0] + cuts, cuts + [len(paths)]):
            first, last = index[lo], bounds.index(hi) - 1
            names.append(labels[first] if first == last else f"{labels[first]}..{labels[last]}")
        return cuts, names
    inner = []  # per piece: the places inside it that may be cut
    for lo, hi in zip(bounds, bounds[1:]):
        changes = [i for i in range(lo + 1, hi) if paths[i] != paths[i - 1]]
        inner.append(changes or list(range(lo + 1, hi)))  # no scopes inside (nnx): any operator boundary
    work = [float(costs[lo:hi].sum()) for lo, hi in zip(bounds, bounds[1:])]
    count = [1] * structure.pieces
    for _ in range(num_layers - structure.pieces):
        open_ = [i for i in range(structure.pieces) if count[i] <= len(inner[i])]
        if not open_:
            raise PlanError(f"the model has only {sum(len(c) + 1 for c in inner)} places to cut it into layers; "
                            f"ask for fewer layers")
        best = max(open_, key=lambda i: work[i] / count[i])
        count[best] += 1
    cuts, names = [], []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if i:
            cuts.append(lo)
        if count[i] == 1:
            names.append(labels[i])
            continue
        local = [c - lo for c in inner[i]]
        local = _cheap(local, crossing[lo:hi], costs[lo:hi], count[i])
        within = [lo + c for c in min_max_cuts(costs[lo:hi], local, count[i], cut_costs=crossing[lo:hi])]
        cuts += within
        parts = [_describe(paths[a:b]) for a, b in zip([lo] + within, within + [hi])]
        if len(set(parts)) < len(parts) or not all(p.startswith(labels[i]) for p in parts):
            parts = [f"{labels[i]} ({k + 1}/{count[i]})" for k in range(count[i])]
        names += parts
    return cuts, names


def compute_dtype(graph: OpGraph, op_flops: list[float]) -> str:
    """The dtype most matmul FLOPs run in (a numpy dtype name): a mixed-precision
    step keeps f32 parameters but multiplies in bf16, and the devices' peak to plan
    with is bf16's."""
    by_dtype: dict[str, float] = {}
    for op in graph.ops:
        if op.name in MATMUL_OPS and op.outputs:
            name = str(graph.avals[op.outputs[0]].dtype)
            by_dtype[name] = by_dtype.get(name, 0.0) + op_flops[op.index]
    return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "float32"


def _tp_bytes(graph: OpGraph, analysis: MicrobatchAnalysis, op_layer: dict[int, int],
              num_layers: int) -> tuple[list[int], list[int]]:
    """What tensor parallelism would all-reduce in each layer's forward, the way
    Megatron splits, and in how many all-reduces: matmuls with a weight alternate
    column-split and row-split along the model's depth (q, k, v then o; up and gate
    then down), and each row-split matmul's result is summed across devices. A weighted
    matmul is row-split when the longest chain of weighted matmuls leading to it (itself
    included) is even. An estimate for the planner to price a model axis with; the
    intra-op ILP then lays the stage out for real."""
    depth: dict[int, int] = {}  # forward value -> weighted matmuls on the longest chain to it
    nbytes, count = [0] * num_layers, [0] * num_layers
    for op, layer in sorted(op_layer.items()):
        if analysis.backward[op]:
            continue
        node = graph.ops[op]
        level = max((depth.get(v, 0) for v in node.inputs), default=0)
        if node.name == "dot_general" and any(
                v not in analysis.batch_axis and v not in graph.constants for v in node.inputs):
            level += 1
            if level % 2 == 0:
                nbytes[layer] += graph.nbytes(node.outputs[0])
                count[layer] += 1
        for v in node.outputs:
            depth[v] = level
    return nbytes, count


def _matmul_counts(graph: OpGraph, analysis: MicrobatchAnalysis, op_layer: dict[int, int], op_flops: list[float],
                   num_layers: int) -> tuple[list[int], list[int]]:
    """Each layer's matmul kernels that do work, forward and backward: what the
    planner's efficiency curve charges a fixed `F_half` of work for, as the predictor
    does per traced matmul (hetpar/predict/compute.py)."""
    forward, backward = [0] * num_layers, [0] * num_layers
    for op, layer in op_layer.items():
        if graph.ops[op].name in MATMUL_OPS and op_flops[op] > 0:
            (backward if analysis.backward[op] else forward)[layer] += 1
    return forward, backward


def _saved_bytes(graph: OpGraph, analysis: MicrobatchAnalysis, op_layer: dict[int, int], num_layers: int) -> list[int]:
    """Activations kept for the backward: forward results a backward operator reads,
    charged to the layer that made them."""
    out = [0] * num_layers
    for v, layer in _read_by_backward(graph, analysis, op_layer):
        out[layer] += graph.nbytes(v)
    return out


def _read_by_backward(graph: OpGraph, analysis: MicrobatchAnalysis, op_layer: dict[int, int]) -> list[tuple[int, int]]:
    """(value, its layer) of each forward result a backward operator reads."""
    return [(v, layer) for op, layer in op_layer.items() if not analysis.backward[op] for v in graph.ops[op].outputs
            if any(analysis.backward[c] for c in graph.consumers.get(v, ()) if c in op_layer)]


def _recomputed_bytes(graph: OpGraph, analysis: MicrobatchAnalysis, op_layer: dict[int, int], num_layers: int) -> list[int]:
    """What a backward holds of the forward it reruns in its own program, charged to
    the layer that made it (`_rerun_held`)."""
    out = [0] * num_layers
    for v, layer in _rerun_held(graph, analysis, op_layer).items():
        out[layer] += graph.nbytes(v)
    return out


def _is_buffer(graph: OpGraph, v: int) -> bool:
    """Whether XLA gives value `v` a buffer of its own: what an operator outside
    `FUSED_INTO_READERS` makes, and what a matmul reads (a matmul kernel reads its
    operands from memory: XLA fuses no elementwise work into it, so a GELU's output or
    a layer norm's scaled output that feeds one is written out)."""
    p = graph.producer.get(v)
    if p is None or graph.ops[p].name not in FUSED_INTO_READERS:
        return True
    return any(graph.ops[c].name in MATMUL_OPS for c in graph.consumers.get(v, ()))


def _rerun_held(graph: OpGraph, analysis: MicrobatchAnalysis, op_layer: dict[int, int]) -> dict[int, int]:
    """Forward value -> its layer, for each value a backward rerunning the forward in
    its own program holds. A forward program hands its backward every value the
    backward reads (`_saved_bytes`), each a buffer of its own; but a program that
    recomputes them is one XLA fuses: a value a cheap elementwise or layout operator
    makes (a mask's select, a bias add, softmax's subtract) is recomputed inside each
    fusion that reads it, from its own operands, so what stays live is the nearest
    values that need a buffer (`_is_buffer`). Walking back from what the backward
    reads through fused operators finds them; the walk stops at the step's inputs and
    at batch-free work."""
    held: dict[int, int] = {}
    todo = [v for v, _ in _read_by_backward(graph, analysis, op_layer)]
    seen: set[int] = set()
    while todo:
        v = todo.pop()
        p = graph.producer.get(v)
        if v in seen or p is None or p not in op_layer or analysis.backward[p]:
            continue
        seen.add(v)
        if _is_buffer(graph, v):
            held[v] = op_layer[p]
        else:
            todo += graph.ops[p].inputs
    return held


def _rerun_working_bytes(graph: OpGraph, analysis: MicrobatchAnalysis, op_layer: dict[int, int],
                         num_layers: int) -> list[int]:
    """Per layer, the most bytes its backward holds at once beyond what its rerun
    forward leaves (`_rerun_held`): a liveness walk over the layer's backward operators
    in program order. It starts with the layer's held values and the cotangents later
    layers pass in; each operator adds the buffers it makes (`_is_buffer`) and frees a
    buffer once nothing reads it any more, directly or through fused operators. A
    stage that recomputes holds its layers' values and, while one layer's backward
    runs, this much besides (solver.memory): cotangents, transposed copies, an
    attention block's score-sized gradients, less what the backward has already freed
    of the layer's values (a GPT block's MLP values are gone before its attention's
    gradients are made; XLA's buffer assignment shows the same)."""
    held = _rerun_held(graph, analysis, op_layer)
    end = _last_reads(graph, op_layer)
    out = [0] * num_layers
    by_layer: dict[int, list[int]] = {}
    for op, layer in op_layer.items():
        if analysis.backward[op]:
            by_layer.setdefault(layer, []).append(op)
    for layer, ops in by_layer.items():
        ops.sort()
        live = {v: end.get(v, -1) for v, owner in held.items() if owner == layer}
        start = sum(graph.nbytes(v) for v in live)
        mine = set(ops)
        for op in ops:  # cotangents and other values from later layers' backward that this backward reads
            for v in graph.ops[op].inputs:
                p = graph.producer.get(v)
                if p is not None and p in op_layer and analysis.backward[p] and p not in mine and _is_buffer(graph, v):
                    live.setdefault(v, end.get(v, -1))
        peak = used = sum(graph.nbytes(v) for v in live)
        for op in ops:
            for v in graph.ops[op].outputs:
                if analysis.batch_axis.get(v) is not None and _is_buffer(graph, v):
                    live[v] = end.get(v, op)
                    used += graph.nbytes(v)
            peak = max(peak, used)
            for v in [v for v, last in live.items() if last <= op]:
                used -= graph.nbytes(v)
                del live[v]
        out[layer] = max(peak - start, 0)
    return out


def _last_reads(graph: OpGraph, op_layer: dict[int, int]) -> dict[int, int]:
    """Value -> the last operator (in program order) that reads it, directly or through
    operators XLA fuses into their readers (a value read by one of those stays live
    until that operator's own result is read)."""
    end: dict[int, int] = {}
    for op in sorted(op_layer, reverse=True):
        node = graph.ops[op]
        reach = op
        for u in node.outputs:
            if not _is_buffer(graph, u):
                reach = max(reach, end.get(u, op))
        for v in node.inputs:
            end[v] = max(end.get(v, -1), reach)
    return end


def _largest_bytes(graph: OpGraph, analysis: MicrobatchAnalysis, op_layer: dict[int, int], num_layers: int) -> list[int]:
    """The largest per-example value each layer makes, forward or backward: the size
    of the cotangent buffers its backward passes from operator to operator (the
    working set solver.memory adds while a backward runs)."""
    out = [0] * num_layers
    for op, layer in op_layer.items():
        for v in graph.ops[op].outputs:
            if analysis.batch_axis.get(v) is not None:
                out[layer] = max(out[layer], graph.nbytes(v))
    return out


def _param_bytes(graph: OpGraph, analysis: MicrobatchAnalysis, op_layer: dict[int, int], num_layers: int,
                 unsplit: bool = False) -> list[int]:
    """Bytes of the parameters each layer owns (`param_layers`). `unsplit`: only those
    no matmul reads (the sharding pass lays out matmul operands only, so the model
    axis splits no others)."""
    matmul_read = _matmul_params(graph, parameter_origins(graph, analysis)) if unsplit else set()
    out = [0] * num_layers
    for v, layer in param_layers(graph, analysis, op_layer).items():
        if v not in matmul_read:
            out[layer] += graph.nbytes(v)
    return out


def param_layers(graph: OpGraph, analysis: MicrobatchAnalysis, op_layer: dict[int, int]) -> dict[int, int]:
    """Parameter (batch-free step input) -> the layer whose forward reads it first,
    directly or through batch-free work done once before the microbatches (a
    mixed-precision step casts its f32 parameters to bf16 there: the layer reads the
    cast, but the gradient, its sync and the optimizer state are the f32 input's)."""
    owner: dict[int, int] = {}
    origins = parameter_origins(graph, analysis)
    for op, layer in sorted(op_layer.items()):
        if analysis.backward[op]:
            continue
        for v in graph.ops[op].inputs:
            for p in origins.get(v, ()):
                owner.setdefault(p, layer)
    return owner


_PASS_THROUGH = ("convert_element_type", "transpose", "copy", "copy_p", "reshape")


def _matmul_params(graph: OpGraph, origins: dict[int, tuple[int, ...]]) -> set[int]:
    """The step inputs some matmul reads, directly, through batch-free work, or
    through a cast or transpose inside the microbatch."""
    out: set[int] = set()
    for op in graph.ops:
        if op.name != "dot_general":
            continue
        for v in op.inputs:
            for _ in range(4):
                if v in origins:
                    out.update(origins[v])
                    break
                producer = graph.producer.get(v)
                if producer is None or graph.ops[producer].name not in _PASS_THROUGH:
                    break
                v = graph.ops[producer].inputs[0]
    return out


def parameter_origins(graph: OpGraph, analysis: MicrobatchAnalysis) -> dict[int, tuple[int, ...]]:
    """Batch-free value -> the batch-free step inputs it is computed from, for the
    inputs themselves and for what operators outside the microbatch loop (casts,
    reshapes of parameters) make of them."""
    origins: dict[int, tuple[int, ...]] = {
        v: (v,) for v in graph.invars if analysis.batch_axis.get(v) is None and v not in graph.constants
    }
    for op in graph.ops:
        if analysis.phase[op.index] is Phase.MICRO:
            continue
        found = tuple(dict.fromkeys(p for v in op.inputs for p in origins.get(v, ())))
        if found:
            for v in op.outputs:
                if analysis.batch_axis.get(v) is None:
                    origins[v] = found
    return origins


def _scope_depth(graph: OpGraph, forward: list[int], flops: list[float], num_layers: int) -> int:
    """The shallowest module depth whose scopes, neighbours grouped, give `num_layers`
    substantial pieces (each at least a quarter of an even share of the work); 0 when
    no depth does (then any operator boundary may be cut)."""
    max_depth = max(len(graph.ops[i].module_path) for i in forward)
    threshold = sum(flops) / (4 * num_layers)
    for depth in range(1, max_depth + 1):
        segment_flops: list[float] = []
        previous = None
        for i, f in zip(forward, flops):
            key = graph.ops[i].module_path[:depth]
            if key != previous:
                segment_flops.append(0.0)
                previous = key
            segment_flops[-1] += f
        # Enough work for the layers once neighbouring small scopes are grouped.
        groups, acc = 0, 0.0
        for f in segment_flops:
            acc += f
            if acc >= threshold:
                groups, acc = groups + 1, 0.0
        if groups >= num_layers:
            return depth
    return 0


def _crossing_bytes(graph: OpGraph, forward: list[int], position: dict[int, int]) -> np.ndarray:
    """crossing[c]: bytes of forward values produced before position c and read at or
    after it, i.e. what a cut at c sends to the next stage."""
    delta = np.zeros(len(forward) + 1)
    for i, op in enumerate(forward):
        for v in graph.ops[op].outputs:
            last = max((position[c] for c in graph.consumers.get(v, ()) if c in position), default=i)
            if last > i:
                delta[i + 1] += graph.nbytes(v)
                delta[last + 1] -= graph.nbytes(v)
    return np.cumsum(delta)[: len(forward)]


def _cheap(candidates: list[int], crossing: np.ndarray, costs: np.ndarray, num_layers: int) -> list[int]:
    """The cut candidates that send little: at most a few times what the cheapest
    useful cut sends. A cut with almost no work on one side (before a scan over
    layers whose first input is the batch itself: nothing crosses it) is no baseline:
    measured against it, every boundary between blocks would look dear and the
    model could not be cut between its blocks at all."""
    if len(candidates) < num_layers - 1:
        raise PlanError(f"the model has only {len(candidates) + 1} places to cut it into layers; ask for fewer layers")
    if num_layers == 1:
        return candidates
    before = np.concatenate([[0.0], np.cumsum(costs)])
    margin = before[-1] / (4 * num_layers)
    useful = [c for c in candidates if margin <= before[c] <= before[-1] - margin] or candidates
    cheapest = min(crossing[c] for c in useful)
    ordered = sorted(crossing[c] for c in candidates)
    limit = max(_MAX_CUT_BYTES_FACTOR * max(cheapest, 1.0), ordered[num_layers - 2])
    return [c for c in candidates if crossing[c] <= limit]


def _backward_anchors(graph, forward, backward, keys, depth, position) -> dict[int, int]:
    """Backward op -> forward position whose layer it belongs to."""
    segments: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        segments.setdefault(key, []).append(i)
    last_use: dict[int, int] = {}  # forward value or input -> last forward position reading it
    for i, op in enumerate(forward):
        for v in graph.ops[op].inputs:
            last_use[v] = i
    anchors = {}
    for op in backward:
        match = segments.get(graph.ops[op].module_path[:depth]) if depth else None
        if match and _contiguous(match):
            anchors[op] = match[-1]
            continue
        uses = [last_use[v] for v in graph.ops[op].inputs if v in last_use]
        anchors[op] = max(uses) if uses else len(forward) - 1
    return anchors


def _contiguous(positions: list[int]) -> bool:
    return positions[-1] - positions[0] + 1 == len(positions)


def _describe(keys: list[tuple]) -> str:
    names = []
    for key in keys:
        name = "/".join(key[1:] if len(key) > 1 else key) or "loss"
        if not names or names[-1] != name:
            names.append(name)
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"

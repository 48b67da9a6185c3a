"""Which stage runs each operator of the traced step: the layers' operators where
their layer's stage is, and the once-per-step work before and after the microbatches
where it is needed. Planning (a plan's `operator_stages`) and `like=` plans read it;
compile cuts the step where it says."""

from __future__ import annotations

from hetpar.trace.layers import Layers
from hetpar.trace.microbatch import MicrobatchAnalysis, Phase
from hetpar.trace.opgraph import OpGraph


def op_stages(graph: OpGraph, analysis: MicrobatchAnalysis, layers: Layers, layer_stage: list[int]) -> list[int]:
    """The stage of every operator."""
    n = len(graph.ops)
    stage: list[int | None] = [None] * n
    for op, layer in layers.op_layer.items():
        stage[op] = layer_stage[layer]
    return place_once_ops(graph, analysis, stage)


def place_once_ops(graph: OpGraph, analysis: MicrobatchAnalysis, stage: list[int | None]) -> list[int]:
    """Every operator's stage, given the per-microbatch operators' (`stage`, None
    for the others): where the once-per-step work before and after them runs."""
    # Work nothing places (no user, no input made here) goes to the pipeline's first
    # stage: replica r's own, so a replica's step never runs on another's devices.
    first = min((s for s in stage if s is not None), default=0)
    # Pre work goes to the earliest stage that needs it.
    for op in reversed(graph.ops):
        if analysis.phase[op.index] is Phase.PRE:
            users = [stage[c] for v in op.outputs for c in graph.consumers.get(v, ()) if stage[c] is not None]
            stage[op.index] = min(users) if users else first
    _slice_where_stacked(graph, analysis, stage)

    # Post work follows its inputs (the optimizer update of a layer runs where its
    # gradient was accumulated); work on inputs alone follows its users.
    post = [op for op in graph.ops if analysis.phase[op.index] is Phase.POST]
    for op in post:
        known = [stage[graph.producer[v]] for v in op.inputs if v in graph.producer and stage[graph.producer[v]] is not None]
        stage[op.index] = min(known) if known else None
    for op in reversed(post):
        if stage[op.index] is None:
            users = [stage[c] for v in op.outputs for c in graph.consumers.get(v, ()) if stage[c] is not None]
            stage[op.index] = min(users) if users else first
    return [int(s) for s in stage]


def _slice_where_stacked(graph: OpGraph, analysis: MicrobatchAnalysis, stage: list) -> None:
    """A step input several stages take pieces of (a scan's stacked weights, one
    iteration per piece: jaxpr_ir unrolls scans over layers) is cut where it lives, the
    earliest of those stages, so that each stage receives its pieces and not a copy
    of the whole stack."""
    inputs = set(graph.invars)
    for v in inputs:
        cutters = [
            c for c in graph.consumers.get(v, ())
            if analysis.phase[c] is Phase.PRE and graph.ops[c].name in ("slice", "dynamic_slice")
        ]
        if len({stage[c] for c in cutters}) > 1:
            home = min(stage[c] for c in cutters)
            for c in cutters:
                stage[c] = home

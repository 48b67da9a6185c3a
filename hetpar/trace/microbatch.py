"""Which parts of an unmodified train step run per microbatch, and how they combine.

The step is traced at two batch sizes. A value whose shape changes with the batch
size carries the batch dimension ("per-example"); an operator that reads or writes
one runs once per microbatch. Its outputs that do not carry the batch dimension are
reductions over the batch (the loss sum, the gradients), and the sum over
microbatches of those reductions is the full-batch reduction. Everything else is
batch-independent and runs once: before the microbatches ("pre": parameter casts,
the autodiff seed) or after them ("post": the loss division, the optimizer).

Microbatches are executed with the microbatch-shaped trace but the full-batch
trace's constants, so a `mean` still divides by the full batch size and the
per-microbatch contributions add up exactly to the full-batch values.

Two exceptions keep real training code exact (whole_batch.py): random bits shaped
by the batch, and reductions of batch inputs alone (a masked mean's token count),
run once before the microbatches on the full batch; each microbatch reads its slice.
With a single microbatch nothing is combined, so a step the split refuses for
combining reasons (batch statistics) runs whole instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from hetpar.errors import CombineRefusal, UnsupportedStepError
from hetpar.markers import MARKER_SCOPE
from hetpar.trace.opgraph import OpGraph
from hetpar.trace.whole_batch import whole_batch_ops


class Phase(enum.Enum):
    PRE = "pre"
    MICRO = "micro"
    POST = "post"


# How a reduction over the batch combines across microbatches, by primitive.
_REDUCTION_COMBINE = {
    "reduce_sum": "sum",
    "dot_general": "sum",
    "conv_general_dilated": "sum",
    "scatter-add": "sum",
    "scatter_add": "sum",
    "reduce_max": "max",
    "reduce_min": "min",
}

_USE_MARKERS = (
    "If the step really needs this, compute the loss and gradients with "
    "hetpar.value_and_grad (per-microbatch mean semantics) or use num_microbatches=1."
)


@dataclass
class MicrobatchAnalysis:
    phase: list[Phase]  # per op
    backward: list[bool]  # per op; meaningful for MICRO ops
    batch_axis: dict[int, int]  # per-example value -> the axis that carries the batch
    reductions: dict[int, str]  # MICRO output without batch axis -> "sum" | "max" | "min" | "mean"
    marked: bool = False  # hetpar.value_and_grad markers: per-microbatch semantics, "mean" combine
    # Ops run once before the microbatches on the full batch (whole_batch.py); their
    # per-example outputs are "sliced": each microbatch reads its slice.
    whole_batch: frozenset[int] = frozenset()
    sliced: frozenset[int] = frozenset()
    # One microbatch and nothing to combine: a step the split would refuse runs whole.
    single: bool = False
    full: OpGraph | None = None  # the full-batch trace, which "pre" programs run

    def is_per_example(self, value: int) -> bool:
        return value in self.batch_axis


def analyze(full: OpGraph, probe: OpGraph, batch_invars: list[int], num_microbatches: int = 2) -> MicrobatchAnalysis:
    """Splits the step traced at the full batch (`full`) using a trace at another
    batch size (`probe`) with the same structure. With one microbatch nothing is
    combined, so a step whose split would be refused for combining reasons (batch
    statistics, reductions with no known combine) runs whole instead."""
    try:
        return _analyze(full, probe, batch_invars, single=False)
    except CombineRefusal:
        if num_microbatches != 1:
            raise
        return _analyze(full, probe, batch_invars, single=True)


def _analyze(full: OpGraph, probe: OpGraph, batch_invars: list[int], single: bool) -> MicrobatchAnalysis:
    check_same_structure(full, probe)
    batch_axis = _batch_axes(full, probe)
    for v in full.constants:
        if v in batch_axis:
            raise UnsupportedStepError(
                f"the step captures a constant of shape {full.avals[v].shape} whose size follows the batch "
                "(an array built from the batch shape outside of JAX?); pass it in the batch instead."
            )
    for v in batch_invars:
        if batch_axis.get(v) != 0:
            raise UnsupportedStepError(
                f"a batch input of shape {full.avals[v].shape} has no leading batch dimension; "
                "every leaf of the batch must be split along axis 0."
            )

    n = len(full.ops)
    markers = [op.index for op in full.ops if op.name == "optimization_barrier" and MARKER_SCOPE in op.scope]
    inside_marked = _ancestors(full, markers)
    phase: list[Phase | None] = [None] * n
    whole = set() if markers else whole_batch_ops(full, batch_axis, batch_invars)
    batch_dependent = set(batch_invars)
    for op in full.ops:
        if op.index in whole:
            phase[op.index] = Phase.PRE
            continue
        touches_examples = any(v in batch_axis for v in op.inputs + op.outputs)
        depends = any(v in batch_dependent for v in op.inputs)
        if touches_examples and markers and op.index not in inside_marked:
            raise UnsupportedStepError(
                f"{op.describe()} works on per-example values "
                "after hetpar.value_and_grad; with markers, all per-example work must happen "
                "inside the marked loss function."
            )
        if touches_examples or (depends and op.index in inside_marked):
            phase[op.index] = Phase.MICRO
        elif depends:
            phase[op.index] = Phase.POST
        if touches_examples or depends:
            batch_dependent.update(op.outputs)

    if single:  # work on batch reductions that feeds back into per-example work joins it
        for op in reversed(full.ops):
            if phase[op.index] is Phase.POST and any(
                phase[c] is Phase.MICRO for v in op.outputs for c in full.consumers.get(v, ())
            ):
                phase[op.index] = Phase.MICRO

    # Batch-independent ops feeding microbatch work run before it; the rest after.
    needed_before = set()
    for op in reversed(full.ops):
        if phase[op.index] is None:
            if any(v in needed_before for v in op.outputs):
                phase[op.index] = Phase.PRE
            else:
                phase[op.index] = Phase.POST
        if phase[op.index] in (Phase.PRE, Phase.MICRO):
            needed_before.update(op.inputs)

    if markers:
        reductions = {v: "mean" for i in markers for v in full.ops[i].outputs}
        _check_marked_region_closed(full, phase, reductions)
    elif single:
        reductions = _leaving_reductions(full, phase, batch_axis)
    else:
        reductions = _reductions(full, phase, batch_axis)
        _check_no_cross_example_flow(full, phase, batch_axis, reductions)

    backward = [False] * n
    backward_values: set[int] = set()
    for op in full.ops:
        if phase[op.index] is Phase.MICRO and (op.is_backward or any(v in backward_values for v in op.inputs)):
            backward[op.index] = True
            backward_values.update(op.outputs)
    sliced = frozenset(v for i in whole for v in full.ops[i].outputs if v in batch_axis)
    return MicrobatchAnalysis(
        phase, backward, batch_axis, reductions, marked=bool(markers), whole_batch=frozenset(whole),
        sliced=sliced, single=single, full=full,
    )


def _leaving_reductions(full: OpGraph, phase: list, batch_axis: dict[int, int]) -> dict[int, str]:
    """With one microbatch, the values that leave the per-microbatch work without the
    batch dimension are final as they are: "only" takes the one microbatch's value."""
    outvars = set(full.outvars)
    return {
        v: "only"
        for op in full.ops if phase[op.index] is Phase.MICRO
        for v in op.outputs
        if v not in batch_axis and (v in outvars or any(phase[c] is not Phase.MICRO for c in full.consumers.get(v, ())))
    }


def _ancestors(graph: OpGraph, ops: list[int]) -> set[int]:
    seen, todo = set(ops), list(ops)
    while todo:
        for v in graph.ops[todo.pop()].inputs:
            p = graph.producer.get(v)
            if p is not None and p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


def _check_marked_region_closed(full: OpGraph, phase: list, reductions: dict) -> None:
    for op in full.ops:
        if phase[op.index] is Phase.MICRO:
            continue
        for v in op.inputs:
            p = full.producer.get(v)
            if p is not None and phase[p] is Phase.MICRO and v not in reductions:
                raise UnsupportedStepError(
                    f"{op.describe()} uses a per-microbatch value "
                    "that hetpar.value_and_grad did not return; compute everything that depends "
                    "on the batch inside the loss function."
                )


def input_roles(graph: OpGraph, analysis: MicrobatchAnalysis, batch_invars: list[int]) -> dict[int, str]:
    """What each input of the step is: "batch"; "parameter" (state the per-example
    computation reads, so it has a gradient); "optimizer_state" (state only the
    once-per-step work reads: moments, step counters). Decided from the program,
    not from names, so any state pytree works."""
    batch = set(batch_invars)
    roles = {}
    for v in graph.invars:
        readers = graph.consumers.get(v, [])
        if v in batch:
            roles[v] = "batch"
        elif any(analysis.phase[i] in (Phase.MICRO, Phase.PRE) for i in readers):
            roles[v] = "parameter"
        else:
            roles[v] = "optimizer_state"
    return roles


def check_same_structure(a: OpGraph, b: OpGraph) -> None:
    if a.structure() != b.structure() or a.outvars != b.outvars:
        raise UnsupportedStepError(
            "the train step traces to a different program at another batch size (Python "
            "control flow on the batch shape?); hetpar needs one program whose shapes scale "
            "with the batch: branch on values with jnp.where or jax.lax.cond, not on x.shape."
        )


def _batch_axes(full: OpGraph, probe: OpGraph) -> dict[int, int]:
    axes = {}
    for v, (a, b) in enumerate(zip(full.avals, probe.avals)):
        sa, sb = getattr(a, "shape", ()), getattr(b, "shape", ())
        if sa == sb:
            continue
        differing = [i for i, (x, y) in enumerate(zip(sa, sb)) if x != y]
        if len(sa) != len(sb) or len(differing) != 1:
            raise UnsupportedStepError(
                f"a value of shape {sa} changes rank or several dimensions with the batch size "
                f"(to {sb}); hetpar needs exactly one dimension to follow the batch."
            )
        axes[v] = differing[0]
    return axes


def _reductions(full: OpGraph, phase: list, batch_axis: dict[int, int]) -> dict[int, str]:
    reductions = {}
    for op in full.ops:
        if phase[op.index] is not Phase.MICRO:
            continue
        for v in op.outputs:
            if v in batch_axis:
                continue
            combine = _REDUCTION_COMBINE.get(op.name)
            if combine is None and op.name in ("scan", "while"):
                raise CombineRefusal(
                    f"{op.describe()}, a {op.name} loop, returns a value of shape {full.avals[v].shape} "
                    "that is not per-example, such as a weight gradient it sums inside; hetpar keeps a loop over "
                    "time (one whose scanned inputs are per-example, e.g. an RNN) whole and cannot tell how its "
                    "results combine across microbatches. Use num_microbatches=1; a scan over layers (stacked "
                    "weights as its scanned inputs, flax nn.scan) is split at iteration boundaries instead."
                )
            if combine is None:
                raise CombineRefusal(
                    f"{op.describe()} turns per-example values "
                    "into one of shape "
                    f"{full.avals[v].shape} in a way hetpar cannot combine across microbatches. "
                    + _USE_MARKERS
                )
            if op.name.startswith("scatter") and not _is_zero(full, op.inputs[0]):
                raise CombineRefusal(
                    f"{op.describe()}, a scatter-add over the batch, adds into a non-zero operand; "
                    "summing it per microbatch would count the operand more than once. Add into "
                    "zeros and add the operand afterwards, or use num_microbatches=1."
                )
            reductions[v] = combine
    return reductions


def _is_zero(graph: OpGraph, value: int) -> bool:
    if value in graph.constants:
        return bool(np.all(np.asarray(graph.constants[value]) == 0))
    producer = graph.producer.get(value)
    if producer is None:
        return False
    op = graph.ops[producer]
    if op.name in ("broadcast_in_dim", "convert_element_type", "reshape"):
        return _is_zero(graph, op.inputs[0])
    return False


def _check_no_cross_example_flow(full: OpGraph, phase: list, batch_axis: dict, reductions: dict) -> None:
    post_values = set(reductions)
    for op in full.ops:
        if phase[op.index] is Phase.POST:
            post_values.update(op.outputs)
        elif phase[op.index] is Phase.MICRO:
            mixed = [v for v in op.inputs if v in post_values]
            if mixed:
                raise CombineRefusal(
                    f"{op.describe()} feeds a value reduced "
                    "over the whole batch back into per-example work (batch statistics, e.g. "
                    "BatchNorm, or a loss that is not a sum or mean over examples), so "
                    "microbatches would change the result. " + _USE_MARKERS
                )

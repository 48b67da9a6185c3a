"""Small values that need only the step's inputs are remade where they are read.

Some once-per-step work reads nothing but the step's inputs and makes small values:
a transformer's causal mask and position ids, reshapes of its biases, the
optimizer's step count and the bias corrections Adam derives from it. Cut into
tasks as it is placed (trace/stages.place_once_ops), it costs twice:

- a stage whose "pre" work is only such values dispatches a program of its own
  every step, before its first microbatch, to make a few kilobytes;
- the plan places the shared step count on one stage, so every other stage's
  update reads it from there: their update waits for that stage's update and is a
  second program ("post" phase 1), run after every stage's last backward instead of
  inside its own stage's (compile/step.fusible_updates).

Here such values are remade by each program that reads them where that removes a
dispatch or a wait: the maker is a pre task made only of them (it is then not
dispatched at all), or the reader is on another stage (its phase no longer waits).
The copies are small by definition (`SMALL` elements at most per value: XLA fuses
them into their readers, far below a dispatch's cost); every other operator runs
once, where the plan put it, and a maker that is still needed (a step output such as
the new step count) still runs there.
"""

from __future__ import annotations

from dataclasses import replace
from math import prod
from typing import Sequence

from hetpar.trace.microbatch import MicrobatchAnalysis, Phase
from hetpar.trace.opgraph import OpGraph

# A value of at most this many elements is remade rather than sent: microseconds of
# elementwise work on any device, where a dispatch costs tens of microseconds on a
# GPU and about a millisecond on CPU devices; a long sequence's causal mask is above it.
SMALL = 1 << 16

_EFFECTFUL = ("callback", "debug_print")  # never duplicated: the user sees each call


def remakeable(graph: OpGraph, analysis: MicrobatchAnalysis) -> set[int]:
    """The operators whose outputs may be remade where read: once-per-step work (not
    the whole-batch kind) reading only step inputs that carry no batch, constants and
    other such operators' outputs, each output at most `SMALL` elements."""
    batch = analysis.batch_axis
    made: set[int] = set()
    out: set[int] = set()
    for op in graph.ops:
        if analysis.phase[op.index] is Phase.MICRO or op.index in analysis.whole_batch:
            continue
        if any(e in op.name for e in _EFFECTFUL):
            continue
        if any(v in batch or (v in graph.producer and v not in made) for v in op.inputs):
            continue
        if any(v in batch or prod(graph.avals[v].shape) > SMALL for v in op.outputs):
            continue
        out.add(op.index)
        made.update(op.outputs)
    return out


def remake(tasks: Sequence, graph: OpGraph, free: set[int]) -> list:
    """`tasks` with each value of a `free` operator remade by a reader (its task's
    operators gain the value's chain of free operators, its inputs their inputs)
    where the maker is a pre task of free operators only, none a step output, or the
    reader runs on another stage. Tasks left making nothing anyone reads are dropped."""
    outvars = set(graph.outvars)
    task_of = {i: t for t in tasks for i in t.ops}
    gone = {id(t) for t in tasks if t.kind == "pre" and set(t.ops) <= free
            and not any(v in outvars for i in t.ops for v in graph.ops[i].outputs)}

    def remade_here(v: int, reader) -> bool:  # noqa: ANN001
        p = graph.producer.get(v)
        if p not in free or p in reader.ops:
            return False
        maker = task_of[p]
        return id(maker) in gone or maker.stage != reader.stage

    out = []
    for t in tasks:
        if id(t) in gone:
            continue
        chain = _chain(graph, free, [v for v in t.inputs if remade_here(v, t)])
        if chain:
            ops = sorted(chain.union(t.ops))  # trace order is a dependency order
            t = replace(t, ops=ops, inputs=graph.read_from_outside(ops))
        out.append(t)
    read = {v for t in out for v in t.inputs}
    kept = []
    for t in out:
        outputs = [v for v in t.outputs if v in outvars or v in read]
        if outputs or t.reductions or t.per_microbatch or not set(t.ops) <= free:
            kept.append(replace(t, outputs=outputs) if len(outputs) != len(t.outputs) else t)
    return kept


def _chain(graph: OpGraph, free: set[int], values: list[int]) -> set[int]:
    """The free operators that make `values`, back to the step's inputs."""
    ops: set[int] = set()
    todo = [graph.producer[v] for v in values]
    while todo:
        i = todo.pop()
        if i in ops:
            continue
        ops.add(i)
        todo += [graph.producer[v] for v in graph.ops[i].inputs if v in graph.producer]
    return ops

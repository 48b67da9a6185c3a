"""Runs a compiled step under a pipeline schedule, in this process.

Values live where they were produced; a task that needs a value on another stage's
mesh gets a copy made with `jax.device_put` (cross-mesh transfer) and kept for the
other tasks of that stage. JAX dispatch is asynchronous, so stages on different
meshes overlap without explicit threads; nothing here blocks on a result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Sequence

import jax
import numpy as np

from hetpar.compile.programs import Program
from hetpar.runtime.schedule import Step, order
from hetpar.trace.microbatch import MicrobatchAnalysis, Phase
from hetpar.trace.opgraph import OpGraph


@dataclass
class CompiledStep:
    graph: OpGraph  # traced at one microbatch
    constants: dict[int, Any]  # full-batch trace constants
    analysis: MicrobatchAnalysis
    programs: list[Program]  # in task order
    batch_invars: set[int]
    num_microbatches: int
    microbatch_size: int
    schedule: str = "gpipe"

    @cached_property
    def dispatch_order(self) -> list[Step]:
        return order(self.programs, self.num_microbatches, self.schedule)

    def per_microbatch(self, value: int) -> bool:
        if value in self.batch_invars:
            return True
        producer = self.graph.producer.get(value)
        return (
            producer is not None
            and self.analysis.phase[producer] is Phase.MICRO
            and value not in self.analysis.reductions
        )


@dataclass
class RunStats:
    """What the runtime holds between programs: per stage, the peak bytes of
    per-microbatch values (activations and their gradients) kept for later programs."""

    peak_activation_bytes: dict[int, int] = field(default_factory=dict)

    def observe(self, store: dict) -> None:
        held: dict[int, int] = {}
        for (_, mb), copies in store.items():
            if mb is not None:
                for stage, x in copies.items():
                    held[stage] = held.get(stage, 0) + x.nbytes
        for stage, nbytes in held.items():
            self.peak_activation_bytes[stage] = max(self.peak_activation_bytes.get(stage, 0), nbytes)


def run(step: CompiledStep, flat_args: Sequence[Any], stats: RunStats | None = None) -> list[Any]:
    """Dispatches every program of one step in the schedule's order. With `stats`,
    also records what the step holds at its peak (costs a walk over held values per
    program, so only for measurements)."""
    graph = step.graph
    store: dict[tuple[int, int | None], dict[int, Any]] = {}  # (value, microbatch) -> stage -> array
    inputs = dict(zip(graph.invars, flat_args))

    def source(value: int, mb: int | None) -> Any:
        copies = store.get((value, mb))
        if copies:
            return next(iter(copies.values()))
        arg = inputs[value]
        if mb is None:
            return arg
        size = step.microbatch_size
        if isinstance(arg, jax.Array):  # a static slice: no index crosses from the host
            return jax.lax.slice_in_dim(arg, mb * size, (mb + 1) * size, axis=0)
        return arg[mb * size : (mb + 1) * size]

    def fetch(value: int, mb: int | None, stage: int, sharding: Any) -> Any:
        copies = store.setdefault((value, mb), {})
        if stage not in copies:
            x = source(value, mb)
            # A value already laid out as the program wants it (a parameter this stage
            # returned last step) is used in place: no copy, no dispatch.
            same = getattr(x, "sharding", None) is not None and x.sharding.is_equivalent_to(sharding, x.ndim)
            copies[stage] = x if same else jax.device_put(x, sharding)
        return copies[stage]

    accumulators: dict[int, tuple] = {}
    for item in step.dispatch_order:
        program = step.programs[item.program]
        task = program.task
        mb = item.microbatch
        args = [
            fetch(v, mb if step.per_microbatch(v) else None, task.stage, sharding)
            for v, sharding in zip(task.inputs, program.in_shardings)
        ]
        acc = accumulators.get(item.program)
        if acc is None:
            acc = program.init_acc() if program.init_acc else ()
        outs, accumulators[item.program] = program.fn(acc, *args)
        key = mb if task.per_microbatch else None
        for v, x in zip(task.outputs, outs):
            store[(v, key)] = {task.stage: x}
        if item.last_microbatch:
            for v, x in zip(task.reductions, accumulators.pop(item.program)):
                store[(v, None)] = {task.stage: x}
        if stats is not None:
            stats.observe(store)
        if item.release is not None:
            for k in [k for k in store if k[1] == item.release]:
                del store[k]

    return [_output(v, step, store, inputs) for v in graph.outvars]


def _output(value: int, step: CompiledStep, store: dict, inputs: dict) -> Any:
    if value in step.graph.constants:
        return np.asarray(step.constants[value], dtype=step.graph.avals[value].dtype)
    copies = store.get((value, None))
    if copies:
        return next(iter(copies.values()))
    return inputs[value]

"""Runs a compiled step under a pipeline schedule, in this process.

Values live where they were produced; a task that needs a value on another stage's
mesh gets a copy made with `jax.device_put` (cross-mesh transfer) and kept for the
other tasks of that stage. JAX dispatch is asynchronous, so stages on different
meshes overlap without explicit threads; nothing here blocks on a result. The few
op-by-op calls go through `remote.eager`, so that under jax.distributed a process
only makes placeholders of values computed on other processes' devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hetpar.compile.compiled import CompiledStep, constant_output
from hetpar.compile.order import Step
from hetpar.compile.programs import FusedProgram, Program
from hetpar.runtime.communicator import DevicePath
from hetpar.runtime.remote import eager


@dataclass
class RunStats:
    """What the runtime holds between programs: per stage, the peak bytes of
    per-microbatch values (activations and their gradients) kept for later programs."""

    peak_activation_bytes: dict[int, int] = field(default_factory=dict)

    def observe(self, store: dict) -> None:
        held: dict[int, int] = {}
        for (_, mb, _), copies in store.items():
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
    # (value, microbatch, replica) -> stage -> array. Once-per-step values (microbatch
    # None) are per replica: each data-parallel pipeline has its own.
    store: dict[tuple[int, int | None, int], dict[int, Any]] = {}
    inputs = dict(zip(graph.invars, flat_args))

    def source(value: int, mb: int | None, replica: int) -> Any:
        copies = store.get((value, mb, replica)) or store.get((value, mb, 0))
        if copies:
            return next(iter(copies.values()))
        if value in step.analysis.sliced:  # drawn once for the whole batch: this microbatch's part
            whole = store.get((value, None, replica)) or store[(value, None, 0)]
            start, size = step.microbatch_slice(mb)
            axis = step.analysis.batch_axis[value]
            return eager(lambda x: jax.lax.slice_in_dim(x, start, start + size, axis=axis), next(iter(whole.values())))
        arg = inputs[value]
        if mb is None:
            return arg
        start, size = step.microbatch_slice(mb)
        if isinstance(arg, jax.Array):  # a static slice: no index crosses from the host
            return eager(lambda x: jax.lax.slice_in_dim(x, start, start + size, axis=0), arg)
        return arg[start : start + size]

    def fetch(value: int, mb: int | None, replica: int, stage: int, sharding: Any) -> Any:
        copies = store.setdefault((value, mb, replica), {})
        if stage not in copies:
            # A value already laid out as the program wants it (a parameter this stage
            # returned last step) is used in place: no copy, no dispatch.
            copies[stage] = _PATH.to_mesh(source(value, mb, replica), sharding)
        return copies[stage]

    accumulators: dict[int, tuple] = {}
    returned = set(graph.outvars)
    input_keys = step.input_keys
    for item in step.order:
        if item.combine:
            _combine_replicas(step, store)
            continue
        program = step.programs[item.program]
        task = program.task
        replica = step.replica_of[item.program] if step.replica_of else 0
        mb = item.microbatch
        stage = task.stage
        if item.fused is not None:
            _run_fused(step.fused[item.program], item, input_keys[item.program], replica, accumulators, fetch, store, program)
        else:
            args = [fetch(v, mb if per_mb else None, replica, stage, sharding)
                    for v, per_mb, sharding in zip(task.inputs, input_keys[item.program], program.in_shardings)]
            acc = accumulators.get(item.program)
            if acc is None:
                acc = program.init_acc() if program.init_acc else ()
            outs, accumulators[item.program] = program.fn(acc, *args)
            key = mb if task.per_microbatch else None
            for v, x in zip(task.outputs, outs):
                store[(v, key, replica)] = {stage: x}
            if item.last_microbatch:
                final = accumulators.pop(item.program)
                if program.finish is not None:
                    final = program.finish(final)
                for v, x in zip(task.reductions, final):
                    store[(v, None, replica)] = {stage: x}
        if stats is not None:
            stats.observe(store)
        if item.release is not None:
            for k in [k for k in store if k[1] == item.release and k[0] not in returned]:
                del store[k]

    return [_output(v, step, store, inputs) for v in graph.outvars]


def _run_fused(fused: FusedProgram, item: Step, flags: tuple[bool, ...], replica: int, accumulators: dict,
               fetch: Callable, store: dict, program: Program) -> None:
    """A stage's last microbatch with its update: the microbatch's outputs, the
    reductions still read elsewhere and the update's results go to the store."""
    task, mb, stage = fused.task, item.microbatch, fused.task.stage
    n = len(task.inputs)
    args = [fetch(v, mb if per_mb else None, replica, stage, sh)
            for v, per_mb, sh in zip(task.inputs, flags, fused.in_shardings[:n])]
    args += [fetch(v, None, replica, stage, sh) for v, sh in zip(fused.post_inputs, fused.in_shardings[n:])]
    acc = accumulators.pop(item.program, None)
    if acc is None:
        acc = program.init_acc() if fused.accumulates and program.init_acc else ()
    outs, finals, updated = fused.fn(acc, *args)
    for v, x in zip(task.outputs, outs):
        store[(v, mb, replica)] = {stage: x}
    for v, x in zip((*fused.reductions, *fused.post.outputs), (*finals, *updated)):
        store[(v, None, replica)] = {stage: x}


_PATH = DevicePath()
MERGE = {"sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum}


def _combine_replicas(step: CompiledStep, store: dict) -> None:
    """Each replica accumulated its own share of every reduction (gradients, loss
    sums); replica 0 receives the others' and combines them, so its post work sees
    the full batch's."""
    for (value, mb, replica), copies in list(store.items()):
        if mb is not None or replica == 0 or value not in step.analysis.reductions:
            continue
        home = store.get((value, None, 0))
        other = next(iter(copies.values()))
        if not home:
            store[(value, None, 0)] = copies
            continue
        stage, mine = next(iter(home.items()))
        moved = _PATH.to_mesh(other, mine.sharding)
        store[(value, None, 0)] = {stage: eager(MERGE[step.analysis.reductions[value]], mine, moved)}
        del store[(value, mb, replica)]


def _output(value: int, step: CompiledStep, store: dict, inputs: dict) -> Any:
    if value in step.graph.constants:
        return constant_output(step.constants[value], step.graph.avals[value])
    copies = store.get((value, None, 0))
    if copies:
        return next(iter(copies.values()))
    if step.per_microbatch(value) and value not in inputs:
        return _concatenate(value, step, store)
    return inputs[value]


def _concatenate(value: int, step: CompiledStep, store: dict) -> Any:
    """A per-example output (logits, per-example losses): the microbatches' pieces laid
    end to end along the batch axis, on the mesh of the first."""
    mine = sorted((mb, c) for (v, mb, _), c in store.items() if v == value and mb is not None)
    pieces = [next(iter(c.values())) for _, c in mine]
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0].sharding
    pieces = [_PATH.to_mesh(p, first) for p in pieces]
    return eager(lambda *xs: jnp.concatenate(xs, axis=step.analysis.batch_axis[value]), *pieces)

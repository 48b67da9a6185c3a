"""The one runtime core: walks a compiled step's instruction order and keeps its books.

Every runtime runs a step through `interpret`: it owns the value store (which value of
which microbatch and replica lies where), the accumulators, the replicas' combine,
microbatch slices and the release of dead values. Where values live and how programs
run is a `Transport`'s business:

- `DeviceTransport` (runtime/executor.py): values are jax Arrays, moved between stage
  meshes with `device_put`, in one process or across the processes of a
  `jax.distributed` job (communicator.DevicePath);
- `RayTransport` (runtime/ray_runtime.py): values are handles to arrays held by the
  Ray actor that owns a stage's mesh; they cross between actors as host arrays
  through Ray's object store.

A mixed-kind stage's parts (compile/step.mixed_rows) each run their rows of every
microbatch: `MixedStages` (runtime/mixed.py) cuts their inputs, joins their outputs
for the stages that read them whole and sums their reductions on every part (before
the replicas'), each part then updating its own copy of the state. Data-parallel
replicas likewise: every replica sums all replicas' shares in one order and runs its
own update (runtime/replicas.py). The runtime keeps those copies between calls
(runtime/copies.StateCopies), so the next step copies no parameters to a part or a
replica; the step returns replica 0's (its lead's) results.

The interpreter never looks inside a value or a target (where an input must be for
its program): it only hands them to the transport, so a runtime gains every feature
of the instruction stream (chunks, dropout slices, ZeRO layouts, fused updates,
replicas) without code of its own. The loop is the hot path of every step: per
program input it does one dictionary lookup, and one transport call only when the
value is not already at the program's stage. A whole-batch value is cut into its
microbatches once per stage that reads them (`Transport.split`), not once per
microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from hetpar.compile.compiled import CompiledStep, constant_output
from hetpar.runtime.copies import StateCopies
from hetpar.runtime.mixed import MixedStages
from hetpar.runtime.replicas import combine_replicas, update_homes
from hetpar.runtime.sums import MERGE_KIND


class Transport(Protocol):
    """Where a step's values live and how its programs run. A value is whatever the
    transport returns (an array, a handle); a target is what `targets` gives per
    program input (a sharding, an actor)."""

    frees: bool  # whether values dropped from the store must be freed explicitly (`free`)
    targets: Sequence[tuple]  # per program, per input: where the value must be for it
    fused_targets: dict[int, tuple]  # per fused host program: its inputs', then its post inputs'

    def move(self, x: Any, target: Any) -> Any:
        """`x` (a value or a step argument) where `target` wants it."""

    def split(self, x: Any, pieces: tuple[tuple[int, int], ...], axis: int, target: Any) -> list:
        """Microbatches' parts ((start, size) along `axis`) of a whole-batch value or
        argument, each where `target` wants it."""

    def call(self, program: int, acc: Any, args: list, last: bool) -> tuple[Sequence[Any], Any]:
        """Runs `program` (acc None: from fresh accumulators). Returns its outputs and
        its accumulators, or with `last` its finished reductions (one per value)."""

    def call_fused(self, program: int, acc: Any, args: list) -> tuple[Sequence[Any], Sequence[Any], Sequence[Any]]:
        """Runs `program`'s last microbatch with the update folded in: outputs, the
        finished reductions still needed, and the update's outputs."""

    def merge(self, how: str, home: Any, other: Any) -> Any:
        """`other` combined into `home` (`how`: a MERGE_KIND value), where `home` lies."""

    def concatenate(self, pieces: list, axis: int) -> Any:
        """Microbatches' pieces of a per-example output, end to end along `axis`."""

    def free(self, values: list) -> None:
        """`values` are dead (only called when `frees`)."""

    def results(self, outputs: list) -> list:
        """The step's outputs as the caller gets them, once every program has run."""


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


def interpret(step: CompiledStep, transport: Transport, flat_args: Sequence[Any], stats: RunStats | None = None,
              kept: StateCopies | None = None) -> list[Any]:
    """Runs every instruction of one step in the schedule's order over `transport`.
    With `stats`, also records what the step holds at its peak (costs a walk over
    held values per program, so only for measurements). With `kept` (held by the
    runtime between its calls), a mixed stage's part or a replica r > 0 reads its own
    copy of the state it updated last step, where an argument is the very array the
    step returned for it, and keeps this step's copies for the next."""
    graph, analysis = step.graph, step.analysis
    # (value, microbatch, replica) -> stage -> value. Once-per-step values (microbatch
    # None) are per replica: each data-parallel pipeline has its own.
    store: dict[tuple[int, int | None, int], dict[int, Any]] = {}
    inputs = dict(zip(graph.invars, flat_args))
    copied = bool(step.parts or step.replica_of)  # updates that run on copies of the returned state
    carried = kept.carried(inputs) if kept is not None and copied else {}
    move, call = transport.move, transport.call

    def source(value: int, mb: int | None, replica: int, stage: int) -> Any:
        mine = carried.get(value, {}).get(stage) if carried else None
        if mine is not None:  # a part's own copy of the state it updated last step
            return mine
        copies = store.get((value, mb, replica)) or store.get((value, mb, 0))
        if copies:
            return next(iter(copies.values()))
        return inputs[value]

    def split(value: int, replica: int, stage: int, target: Any) -> None:
        """Every microbatch's part of a whole-batch value (drawn once for the whole
        batch) or argument, at `stage`: cut at once (one program on a device
        transport), the first time a microbatch's part is read there."""
        if value in analysis.sliced:
            whole = store.get((value, None, replica)) or store[(value, None, 0)]
            x, axis = next(iter(whole.values())), analysis.batch_axis[value]
        else:
            x, axis = inputs[value], 0
        mbs = step.replica_microbatches(replica)
        for mb, part in zip(mbs, transport.split(x, tuple(map(step.microbatch_slice, mbs)), axis, target)):
            store.setdefault((value, mb, replica), {})[stage] = part

    def fetch(value: int, mb: int | None, replica: int, stage: int, target: Any) -> Any:
        if mb is not None and stage in rows:
            return parts.fetch(value, mb, replica, stage, target)
        copies = store.get((value, mb, replica))
        if copies is None:
            if mb is not None and (value in analysis.sliced or value in inputs):
                split(value, replica, stage, target)
                return store[(value, mb, replica)][stage]
            copies = store[(value, mb, replica)] = parts.joined(value, mb, replica)
        elif stage in copies:
            return copies[stage]
        # A value already where the program wants it (a parameter this stage
        # returned last step) is used in place: no copy, no dispatch.
        x = copies[stage] = move(source(value, mb, replica, stage), target)
        return x

    rows = step.rows
    homes = update_homes(step, transport.targets) if step.replica_of else {}
    parts = MixedStages(step, transport, store, inputs, MERGE_KIND)
    accumulators: dict[int, Any] = {}
    returned = set(graph.outvars)
    input_keys, tasks, targets = step.input_keys, step.tasks, transport.targets
    # Per per-microbatch program: its arguments at its first microbatch. Its
    # once-per-step inputs (parameters, pre work's results) are ready before any
    # microbatch and do not change during the step, so later microbatches reuse them.
    once: dict[int, list] = {}
    microbatch_inputs = step.microbatch_inputs

    def arguments(p: int, values: Sequence[int], wanted: Sequence[Any], mb: int | None, replica: int, stage: int) -> list:
        """Program p's inputs `values` (where `wanted`) at microbatch `mb`. A
        per-microbatch program's first dispatch fetches them all; a later one (its
        last, with the update folded in, too) reuses the once-per-step ones."""
        args = once.get(p)
        if args is None:
            args = [fetch(v, mb if per_mb else None, replica, stage, target)
                    for v, per_mb, target in zip(values, input_keys[p], wanted)]
            if tasks[p].per_microbatch:
                once[p] = args
            return args
        args = args.copy()
        for i in microbatch_inputs[p]:
            args[i] = fetch(values[i], mb, replica, stage, wanted[i])
        return args

    for item in step.order:
        if item.combine:
            parts.combine()
            combine_replicas(step, store, transport, homes)
            continue
        p = item.program
        task = tasks[p]
        replica = step.replica_of[p] if step.replica_of else 0
        mb = item.microbatch
        stage = task.stage
        if item.fused is not None:
            _run_fused(step, transport, p, mb, replica, accumulators, fetch, store, arguments)
        else:
            args = arguments(p, task.inputs, targets[p], mb, replica, stage)
            outs, acc = call(p, accumulators.pop(p, None), args, item.last_microbatch)
            key = mb if task.per_microbatch else None
            if task.per_microbatch and stage in rows:  # a part of a mixed stage: its rows, its share of the reductions
                parts.made(task, mb, replica, outs, acc if item.last_microbatch else None)
            elif stage in rows and stage not in step.parts:  # a part's update: its copy beside the lead's
                for v, x in zip(task.outputs, outs):
                    store.setdefault((v, key, replica), {})[stage] = x
            else:
                for v, x in zip(task.outputs, outs):
                    store[(v, key, replica)] = {stage: x}
                if item.last_microbatch:
                    for v, x in zip(task.reductions, acc):
                        store[(v, None, replica)] = {stage: x}
            if not item.last_microbatch:
                accumulators[p] = acc
        if stats is not None:
            stats.observe(store)
        if item.release is not None:
            dead = [k for k in store if k[1] == item.release and k[0] not in returned]
            if transport.frees:
                transport.free([x for k in dead for x in store[k].values()])
            for k in dead:
                del store[k]
            parts.release(item.release, returned)

    parts.join_outputs(returned)
    outputs = [_output(v, step, store, inputs, transport) for v in graph.outvars]
    if kept is not None and copied:
        kept.keep(step, graph.outvars, outputs, store)
    return transport.results(outputs)


def _run_fused(step: CompiledStep, transport: Transport, p: int, mb: int, replica: int, accumulators: dict,
               fetch: Any, store: dict, arguments: Any) -> None:
    """A stage's last microbatch with its update: the microbatch's outputs, the
    reductions still read elsewhere and the update's results go to the store. Its
    microbatch inputs are the program's own (`arguments`: laid out as in its other
    microbatches), then the update's."""
    task, folded = step.tasks[p], step.fusions[p]
    stage, n = task.stage, len(folded.inputs)  # a folded pre program's outputs are made inside
    targets = transport.fused_targets[p]
    args = arguments(p, folded.inputs, targets[:n], mb, replica, stage) + [
        fetch(v, None, replica, stage, t) for v, t in zip(folded.post_inputs, targets[n:])]
    outs, finals, updated = transport.call_fused(p, accumulators.pop(p, None), args)
    for v, x in zip(task.outputs, outs):
        store[(v, mb, replica)] = {stage: x}
    for v, x in zip((*folded.reductions, *folded.post.outputs), (*finals, *updated)):
        store[(v, None, replica)] = {stage: x}


def _output(value: int, step: CompiledStep, store: dict, inputs: dict, transport: Transport) -> Any:
    if value in step.graph.constants:
        return constant_output(step.constants[value], step.graph.avals[value])
    copies = store.get((value, None, 0))
    if copies:
        return next(iter(copies.values()))
    if step.per_microbatch(value) and value not in inputs:
        mine = sorted((mb, c) for (v, mb, _), c in store.items() if v == value and mb is not None)
        pieces = [next(iter(c.values())) for _, c in mine]
        return pieces[0] if len(pieces) == 1 else transport.concatenate(pieces, step.analysis.batch_axis[value])
    return inputs[value]

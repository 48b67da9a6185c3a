"""What running a step costs the host beyond its programs, as runs a profile can time.

A step is more than its programs: the interpreter walks the schedule's instructions in
Python (a dictionary lookup per program input, the once-per-step inputs checked
against where the program wants them, the store's bookkeeping) and cuts each batch
argument into its microbatches (`Transport.split`). The layer profile times programs
and copies, not these; on devices that are the host's own cores (CPU virtual devices,
timed with the process's CPU time) they are part of every step's time. Two runs
measure them on a compiled step:

- the interpreter alone: the step interpreted over a transport that hands back what
  each call returned in one real run (recorded), so no program, split or copy runs,
  only the runtime's own host work; divided by the programs the step dispatches, it
  is what the runtime adds per program dispatch (`LayerRecord.dispatch_s`);
- the batch split: every split the step made, made again with the real transport on
  the same arguments: what cutting the batch costs a pipeline once per step
  (`LayerPointRecord.split_s`).

hetpar.predict and hetpar.runtime do not know each other: the profiler gets
`host_runs` from its caller (the CLI, the accuracy benchmark).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax

from hetpar.compile.compiled import CompiledStep
from hetpar.compile.programs import shared_zeros
from hetpar.runtime.communicator import already_there
from hetpar.runtime.executor import DeviceTransport
from hetpar.runtime.interpreter import interpret

log = logging.getLogger("hetpar.runtime")


@dataclass(frozen=True)
class HostRuns:
    """The two runs (each returns something to wait on) and the programs the step
    dispatches, which the interpreter's time is divided by."""

    interpreter: Callable[[], Any]
    split: Callable[[], Any] | None  # None: the step cuts no batch argument
    dispatches: int


@dataclass
class _Recording:
    """The real transport, keeping the shape, dtype and sharding of what every call
    returned (`_stand_in`) and every split's arguments. Not the values: they are every
    value the step makes (every stage's activations, a second new state), held beside the
    profile's own arrays (with them a 1.26B Llama's profile ran out of a 141 GB GPU's
    memory), and the replay only hands values on and checks where they lie."""

    real: DeviceTransport
    returned: list = field(default_factory=list)
    splits: list = field(default_factory=list)
    dispatches: int = 0
    frees = False

    def __post_init__(self) -> None:
        self.targets, self.fused_targets = self.real.targets, self.real.fused_targets

    def move(self, x: Any, target: Any) -> Any:
        return self.real.move(x, target)

    def _kept(self, out: Any) -> Any:
        self.returned.append(jax.tree.map(_stand_in, out))
        return out

    def split(self, x: Any, pieces: tuple, axis: int, target: Any) -> list:
        self.splits.append((x, pieces, axis, target))
        return self._kept(self.real.split(x, pieces, axis, target))

    def call(self, program: int, acc: Any, args: list, last: bool) -> Any:
        self.dispatches += 1
        return self._kept(self.real.call(program, acc, args, last))

    def call_fused(self, program: int, acc: Any, args: list) -> Any:
        self.dispatches += 1
        return self._kept(self.real.call_fused(program, acc, args))

    def merge(self, how: str, home: Any, other: Any) -> Any:
        return self._kept(self.real.merge(how, home, other))

    def concatenate(self, pieces: list, axis: int) -> Any:
        return self._kept(self.real.concatenate(pieces, axis))

    def free(self, values: list) -> None:
        pass

    def results(self, outputs: list) -> list:
        return outputs


class _Replay:
    """A transport whose calls hand back what a recorded run's returned, in order:
    interpreting over it costs the interpreter's host work alone. A move makes the
    check the runtime makes (`already_there`) and no copy: a value between two meshes
    is a send, which the profile times apart (`LayerPointRecord.send_s`)."""

    frees = False

    def __init__(self, recording: _Recording):
        self.targets, self.fused_targets = recording.targets, recording.fused_targets
        self._returned, self._next = recording.returned, 0

    def move(self, x: Any, target: Any) -> Any:
        return x if already_there(x, target) else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)

    def _give(self, *_: Any) -> Any:
        out = self._returned[self._next]
        self._next += 1
        return out

    split = call = call_fused = merge = concatenate = _give

    def free(self, values: list) -> None:
        pass

    def results(self, outputs: list) -> list:
        return outputs


def step_arguments(step: CompiledStep) -> list[Any] | None:
    """Zero-filled arguments of `step`: each batch argument whole (all microbatches)
    on the default device, as a caller's batch arrives; every other one where the
    first program that reads it wants it, one array per shape, dtype and placement
    (`shared_zeros`: a Llama's blocks then hold one block's zeros, not a whole
    state's). None where an argument cannot be made of zeros (a PRNG key)."""
    wanted: dict[int, Any] = {}
    for program in step.programs:
        if program is not None:
            for v, sharding in zip(program.task.inputs, program.in_shardings):
                wanted.setdefault(v, sharding)
    made: dict = {}
    out = []
    for v in step.graph.invars:
        aval = step.graph.avals[v]
        if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
            return None
        if v in step.batch_invars:
            out.append(shared_zeros(made, (aval.shape[0] * step.num_microbatches, *aval.shape[1:]), aval.dtype))
        else:
            out.append(shared_zeros(made, aval.shape, aval.dtype, wanted.get(v)))
    return out


def _stand_in(x: Any) -> Any:
    """An array's shape, dtype and sharding without its buffer."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x


def host_runs(step: CompiledStep) -> HostRuns | None:
    """The runtime's host work of `step` as two runs to time (`HostRuns`); None where
    the step's arguments cannot be made here (`step_arguments`)."""
    args = step_arguments(step)
    if args is None:
        log.info("no host-cost runs: the step takes an argument that cannot be made of zeros")
        return None
    recording = _Recording(DeviceTransport(step))
    jax.block_until_ready(interpret(step, recording, args))
    splits = recording.splits
    real = recording.real
    args = [_stand_in(a) for a in args]  # nor the arguments, as long as the profile times

    def split() -> list:
        return [real.split(x, pieces, axis, target) for x, pieces, axis, target in splits]

    def interpreter() -> None:  # what it hands back was waited on when recorded (and partly donated since)
        interpret(step, _Replay(recording), args)

    return HostRuns(interpreter, split if splits else None, recording.dispatches)


__all__: Sequence[str] = ["HostRuns", "host_runs", "step_arguments"]

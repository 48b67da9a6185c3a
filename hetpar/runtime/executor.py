"""Runs a compiled step in this process: the interpreter over device-to-device copies.

Values live where they were produced; a task that needs a value on another stage's
mesh gets a copy made with `jax.device_put` (cross-mesh transfer) and kept for the
other tasks of that stage. JAX dispatch is asynchronous, so stages on different
meshes overlap without explicit threads; nothing here blocks on a result. The few
op-by-op calls go through `remote.eager`, so that under jax.distributed a process
only makes placeholders of values computed on other processes' devices (the same
transport serves every process of such a job: runtime/distributed.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hetpar.compile.compiled import CompiledStep
from hetpar.runtime.communicator import DevicePath, HostStagedPath
from hetpar.runtime.interpreter import RunStats, interpret
from hetpar.runtime.copies import StateCopies
from hetpar.runtime.nvme_tier import NvmeRun
from hetpar.runtime.remote import eager

__all__ = ["DeviceTransport", "StateCopies", "RunStats", "run", "MERGE"]

_PATH = DevicePath()
_HOST = HostStagedPath()
MERGE = {"add": jnp.add, "maximum": jnp.maximum, "minimum": jnp.minimum}


class DeviceTransport:
    """Values are jax Arrays; a target is the sharding a program wants an input in."""

    frees = False  # dropping the store's reference frees an array

    def __init__(self, step: CompiledStep):
        self.programs, self.fused = step.programs, step.fused
        self.targets = [p.in_shardings if p is not None else () for p in step.programs]
        self.fused_targets = {i: f.in_shardings for i, f in step.fused.items()}
        self.vendors = step.vendors
        self.move = self._between_vendors if self.vendors else _PATH.to_mesh

    def _between_vendors(self, x: Any, target: Any) -> Any:
        """`x` where `target` wants it: through the host where the two ends are of
        different vendors (no device link joins them), device to device otherwise."""
        if self._crosses(x, target):
            return _HOST.to_mesh(x, target)
        return _PATH.to_mesh(x, target)

    def _crosses(self, x: Any, target: Any) -> bool:
        here = getattr(x, "sharding", None)
        if here is None or not self.vendors:
            return False
        ends = {self.vendors.get(d.id) for d in (*here.device_set, *target.device_set)}
        return len(ends - {None}) > 1

    def split(self, x: Any, pieces: tuple[tuple[int, int], ...], axis: int, target: Any) -> list:
        if len(pieces) == 1 and pieces[0] == (0, np.shape(x)[axis]):  # one microbatch: the whole value
            return [self.move(x, target)]
        cut = None if self._crosses(x, target) else _PATH.split_to(x, pieces, axis, target)
        if cut is not None:
            return cut
        return [self.move(self._slice(x, start, size, axis), target) for start, size in pieces]

    @staticmethod
    def _slice(x: Any, start: int, size: int, axis: int) -> Any:
        if isinstance(x, jax.Array):  # a static slice: no index crosses from the host
            return eager(lambda a: jax.lax.slice_in_dim(a, start, start + size, axis=axis), x)
        return x[(slice(None),) * axis + (slice(start, start + size),)]

    def call(self, program: int, acc: Any, args: list, last: bool) -> tuple[Any, Any]:
        return self.programs[program].run(acc, args, last)

    def call_fused(self, program: int, acc: Any, args: list) -> tuple[Any, Any, Any]:
        fused = self.fused[program]
        if acc is None:
            init = self.programs[program].init_acc
            acc = init() if fused.accumulates and init else ()
        return fused.fn(acc, *args)

    def merge(self, how: str, home: Any, other: Any) -> Any:
        return eager(MERGE[how], home, self.move(other, home.sharding))

    def concatenate(self, pieces: list, axis: int) -> Any:
        """On the mesh of the first piece."""
        first = pieces[0].sharding
        pieces = [self.move(p, first) for p in pieces]
        return eager(lambda *xs: jnp.concatenate(xs, axis=axis), *pieces)

    def free(self, values: list) -> None:
        pass

    def results(self, outputs: list) -> list:
        return outputs


def run(step: CompiledStep, flat_args: Sequence[Any], stats: RunStats | None = None,
        nvme: NvmeRun | None = None, kept: StateCopies | None = None) -> list[Any]:
    """Dispatches every program of one step in the schedule's order, in this process.
    With `nvme`, state on the NVMe tier is read where a program first wants it and the
    new state written as it is made, one generation committed when the step is done
    (runtime/nvme_tier.py); a step that raises commits nothing. `kept`: the caller's
    mixed-stage parts' and replicas' state copies between calls (runtime/copies.py; not under NVMe,
    whose outputs are handles)."""
    transport = DeviceTransport(step)
    if nvme is None:
        return interpret(step, transport, flat_args, stats, kept)
    try:
        outputs = interpret(step, nvme.over(transport), flat_args, stats)
    except BaseException:
        nvme.abort()
        raise
    try:
        return nvme.commit(outputs)
    except BaseException:
        nvme.abort()
        raise

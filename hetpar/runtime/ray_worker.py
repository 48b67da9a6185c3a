"""A Ray actor that owns one device group's mesh and carries out the driver's instructions.

The worker receives the train step and abstract arguments (cloudpickled by Ray),
traces it again and checks the trace against the plan's fingerprint, then compiles
the programs of its stages (every chunk of an interleaved plan on its device group)
from the plan alone (operator stages and shardings are the plan's; it solves
nothing), so what runs here is exactly the program the plan was made for.
(Re-tracing rather than shipping serialized StableHLO keeps JAX versions free to
differ between vendors' machines, and the fingerprint turns any drift into a clear
error.)

It decides nothing: the driver's interpreter (runtime/interpreter.py) names every
value by an id and tells the worker what to run, slice, merge, send or free. Values
stay on its devices; what another worker needs leaves as a host array through Ray's
object store (`export`) and arrives as an argument of the instruction that first
reads it.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from hetpar.plan import Plan
from hetpar.runtime.communicator import DevicePath, from_host, to_host


class StageWorker:
    def __init__(self, num_devices: int, platform: str = "cpu"):
        import jax

        if platform == "cpu":
            jax.config.update("jax_num_cpu_devices", num_devices)
        self._num_devices = num_devices
        self._values: dict[int, Any] = {}  # the driver's id -> an array (or accumulators) on this mesh

    def pid(self) -> int:
        return os.getpid()

    def build(self, fn: Callable, args: tuple, batch_argnum: int, plan: Plan, stages: tuple[int, ...]) -> int:
        """Traces, checks and compiles the programs of `stages` (all on this worker's
        devices). Returns how many."""
        from hetpar.compile.programs import stage_mesh
        from hetpar.compile.step import compile_step, microbatch_graphs
        from hetpar.errors import PlanError
        from hetpar.trace.fingerprint import differences, signature
        from hetpar.trace.traced_step import trace_step

        traced = trace_step(fn, args, batch_argnum, plan.num_microbatches)
        if plan.program is not None and differences(plan.program, signature(traced.full)):
            names = ", ".join(map(str, stages))
            raise PlanError(f"stage {names}'s worker traced a different program: "
                            f"{'; '.join(differences(plan.program, signature(traced.full)))}")
        devices = tuple(range(self._num_devices))  # the first devices of this process
        meshes = {s: stage_mesh(devices, plan.stages[s].mesh_shape, plan.stages[s].zero_group) for s in stages}
        graphs = microbatch_graphs(fn, args, batch_argnum, traced, plan)
        step = compile_step(traced, plan, meshes, graphs, keep=lambda s: s in meshes)
        self._programs, self._fused, self._tasks = step.programs, step.fused, step.tasks
        return sum(p is not None for p in self._programs) + len(self._fused)

    def _inputs(self, ids: tuple[int, ...], shardings: tuple, arrivals: tuple[int, ...], received: tuple) -> list:
        """The values `ids` laid out as `shardings` on this mesh; `arrivals` (ids) came
        with this instruction as host arrays (`received`) and are kept laid out."""
        values = self._values
        for i, x in zip(arrivals, received):
            values[i] = x
        path = DevicePath()
        out = []
        for i, sharding in zip(ids, shardings):
            x = values[i]
            x = values[i] = from_host(x, sharding) if not hasattr(x, "sharding") else path.to_mesh(x, sharding)
            out.append(x)
        return out

    def run(self, index: int, acc_id: int | None, ids: tuple[int, ...], out_ids: tuple[int, ...],
            acc_out: tuple[int, ...], last: bool, arrivals: tuple[int, ...], *received: Any) -> int:
        """Runs program `index` on the values `ids`, keeping its outputs as `out_ids`
        and its accumulators as `acc_out` (one id), or with `last` its finished
        reductions (one id each). Returns `index`: a token the driver waits on, so no
        failure goes unnoticed."""
        program = self._programs[index]
        task = program.task
        args = self._inputs(ids, program.in_shardings, arrivals, received)
        acc = self._values.pop(acc_id) if acc_id is not None else None
        try:
            outs, acc = program.run(acc, args, last)
        except Exception as e:
            shapes = ", ".join(f"{v}:{tuple(a.shape)}" for v, a in zip(task.inputs, args))
            raise RuntimeError(f"{task.name} failed on inputs {shapes}: {e}") from e
        self._values.update(zip(out_ids, outs))
        if last:
            self._values.update(zip(acc_out, acc))
        else:
            self._values[acc_out[0]] = acc
        return index

    def run_fused(self, index: int, acc_id: int | None, ids: tuple[int, ...], out_ids: tuple[int, ...],
                  arrivals: tuple[int, ...], *received: Any) -> int:
        """Program `index`'s last microbatch with its stage's update folded in;
        `out_ids` name its outputs, kept reductions and update outputs in order."""
        fused = self._fused[index]
        args = self._inputs(ids, fused.in_shardings, arrivals, received)
        if acc_id is not None:
            acc = self._values.pop(acc_id)
        else:
            init = self._programs[index].init_acc
            acc = init() if fused.accumulates and init else ()
        try:
            outs, finals, updated = fused.fn(acc, *args)
        except Exception as e:
            raise RuntimeError(f"{fused.task.name} with {fused.post.name} failed: {e}") from e
        self._values.update(zip(out_ids, (*outs, *finals, *updated)))
        return index

    def slice(self, source: int, into: int, start: int, size: int, axis: int, arrivals: tuple[int, ...],
              *received: Any) -> int:
        """A microbatch's part of a whole-batch value held here (or arriving with this call)."""
        import jax

        for i, x in zip(arrivals, received):
            self._values[i] = from_host(x)
        self._values[into] = jax.lax.slice_in_dim(self._values[source], start, start + size, axis=axis)
        return into

    def merge(self, how: str, home: int, other: int, into: int, arrivals: tuple[int, ...], *received: Any) -> int:
        """Another replica's (or mixed stage part's) share of a reduction combined into
        this one's. Either may have just arrived from another worker (a part's sum
        starts from the first part's share): it is laid out as the one held here."""
        import jax.numpy as jnp

        for i, x in zip(arrivals, received):
            self._values[i] = x
        mine = self._values[home]
        if hasattr(mine, "sharding"):
            (theirs,) = self._inputs((other,), (mine.sharding,), (), ())
        else:
            theirs = self._values[other]
            (mine,) = self._inputs((home,), (theirs.sharding,), (), ())
        self._values[into] = getattr(jnp, how)(mine, theirs)
        return into

    def concatenate(self, ids: tuple[int, ...], into: int, axis: int, arrivals: tuple[int, ...], *received: Any) -> int:
        """Microbatches' pieces of a per-example output end to end, on this mesh."""
        import jax.numpy as jnp

        first = self._values[ids[0]] if ids[0] not in arrivals else None
        sharding = first.sharding if first is not None else None
        for i, x in zip(arrivals, received):
            self._values[i] = from_host(x, sharding)
        self._values[into] = jnp.concatenate([self._values[i] for i in ids], axis=axis)
        return into

    def export(self, value: int) -> Any:
        """A value as a host array, for another worker or the driver."""
        return to_host(self._values[value])

    def free(self, ids: tuple[int, ...]) -> None:
        for i in ids:
            self._values.pop(i, None)

    def begin_step(self) -> None:
        """Starts a step from nothing but its arguments. The driver calls this before a
        step's first instruction (Ray runs one caller's actor calls in order), so values
        and accumulators a failed or interrupted step left behind are never read."""
        self._values.clear()

    def end_step(self) -> None:
        """Drops everything of this step: the next one brings its own inputs."""
        self._values.clear()

"""A stage's process in the multi-process runtime: owns one mesh, runs its programs.

The worker receives the train step and abstract arguments (cloudpickled by Ray),
traces it again and checks the trace against the plan's fingerprint, then compiles
its programs from the plan alone (operator stages and shardings are the plan's; it
solves nothing), so what runs here is exactly the program the plan was made for. (Re-tracing rather than shipping
serialized StableHLO keeps JAX versions free to differ between vendors' machines,
and the fingerprint turns any drift into a clear error.) Values its own later
programs read stay on its devices; only what other stages need leaves, as host
arrays through Ray's object store.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from hetpar.plan import Plan


class StageWorker:
    def __init__(self, num_devices: int, platform: str = "cpu"):
        import jax

        if platform == "cpu":
            jax.config.update("jax_num_cpu_devices", num_devices)
        self._num_devices = num_devices
        self._values: dict[tuple, Any] = {}  # (value, microbatch or None, replica) -> array on this mesh
        self._acc: dict[int, tuple] = {}

    def pid(self) -> int:
        return os.getpid()

    def build(self, fn: Callable, args: tuple, batch_argnum: int, plan: Plan, stage: int) -> int:
        """Traces, checks and compiles this stage's programs. Returns how many."""
        from hetpar.compile.programs import stage_mesh
        from hetpar.compile.step import compile_tasks, microbatch_graphs, step_tasks
        from hetpar.errors import PlanError
        from hetpar.trace.fingerprint import differences, signature
        from hetpar.trace.traced_step import trace_step

        traced = trace_step(fn, args, batch_argnum, plan.num_microbatches)
        if plan.program is not None and differences(plan.program, signature(traced.full)):
            raise PlanError(f"stage {stage}'s worker traced a different program: {'; '.join(differences(plan.program, signature(traced.full)))}")
        tasks = step_tasks(traced, plan)
        mesh = stage_mesh(tuple(range(self._num_devices)), plan.stages[stage].mesh_shape)  # the first devices of this process
        graphs = microbatch_graphs(fn, args, batch_argnum, traced, plan)
        self._programs = compile_tasks(traced, plan, tasks, {stage: mesh}, graphs, keep=lambda t: t.stage == stage)
        self._analysis = traced.analysis
        self._batch_invars = set(traced.batch_invars)
        self._graph = traced.exec_graph
        return sum(p is not None for p in self._programs)

    def _per_microbatch(self, value: int) -> bool:
        from hetpar.compile.compiled import is_per_microbatch

        return is_per_microbatch(self._graph, self._analysis, self._batch_invars, value)

    def run(self, index: int, mb: int | None, replica: int, last: bool, export: tuple[int, ...], names: tuple[int, ...], *arrays: Any) -> list:
        """Runs program `index` on microbatch `mb`; `arrays` are the inputs named by
        `names` that come from elsewhere. Returns the outputs named by `export`, then
        `index`: a token the driver waits on, so no failure goes unnoticed."""
        from hetpar.runtime.communicator import HostPath

        path = HostPath()
        program = self._programs[index]
        task = program.task
        received = dict(zip(names, arrays))
        args = []
        for v, sharding in zip(task.inputs, program.in_shardings):
            key = (v, mb if self._per_microbatch(v) else None, replica)
            if key not in self._values:
                if v not in received:
                    raise RuntimeError(f"{task.name} needs value {v} (microbatch {key[1]}), which never reached this worker")
                self._values[key] = path.to_mesh(received[v], sharding)
            args.append(self._values[key])
        acc = self._acc.get(index)
        if acc is None:
            acc = program.init_acc() if program.init_acc else ()
        try:
            outs, self._acc[index] = program.fn(acc, *args)
        except Exception as e:
            shapes = ", ".join(f"{v}:{tuple(a.shape)}" for v, a in zip(task.inputs, args))
            raise RuntimeError(f"{task.name} (microbatch {mb}, replica {replica}) failed on inputs {shapes}: {e}") from e
        out_mb = mb if task.per_microbatch else None
        for v, x in zip(task.outputs, outs):
            self._values[(v, out_mb, replica)] = x
        if last:
            final = self._acc.pop(index)
            if program.finish is not None:
                final = program.finish(final)
            for v, x in zip(task.reductions, final):
                self._values[(v, None, replica)] = x
        return [*(path.export(self._values[(v, out_mb, replica)]) for v in export), index]

    def combine(self, value: int, replica: int, other: Any) -> None:
        """Adds another replica's accumulated reduction into this one's."""
        from hetpar.runtime.communicator import HostPath
        from hetpar.runtime.executor import MERGE

        key = (value, None, replica)
        mine = self._values[key]
        self._values[key] = MERGE[self._analysis.reductions[value]](mine, HostPath().to_mesh(other, mine.sharding))

    def export(self, key: tuple) -> Any:
        from hetpar.runtime.communicator import HostPath

        return HostPath().export(self._values[key])

    def release(self, mb: int) -> None:
        for key in [k for k in self._values if k[1] == mb]:
            del self._values[key]

    def begin_step(self) -> None:
        """Starts a step from nothing but its arguments. The driver calls this before a
        step's first program (Ray runs one caller's actor calls in order), so values
        and accumulators a failed or interrupted step left behind are never read."""
        self._values.clear()
        self._acc.clear()

    def end_step(self) -> None:
        """Drops everything of this step: the next one brings its own inputs."""
        self._values.clear()
        self._acc.clear()

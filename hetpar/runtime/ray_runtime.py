"""The multi-process runtime: one Ray actor per stage mesh, the schedule on the driver.

The driver submits every program of a step at once, in the schedule's order; Ray
starts each call when the values it needs exist, so stages in different processes
run concurrently and the driver never waits inside the step. Values cross between
processes as host arrays in Ray's object store (communicator.HostPath). The driver
then waits, with a time limit, on every call's completion token and on the step's
outputs: a worker that raised or died surfaces here as a HetparError naming it.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import jax
import numpy as np

from hetpar.compile.step import step_tasks
from hetpar.errors import HetparError
from hetpar.plan import Plan
from hetpar.compile.compiled import constant_output, is_per_microbatch
from hetpar.runtime.ray_worker import StageWorker
from hetpar.compile.order import order, replicated_order
from hetpar.trace.traced_step import TracedStep

log = logging.getLogger("hetpar.ray")
# How long the driver waits on a step (or on building the stage programs) before it
# reports a stuck worker; set HETPAR_WORKER_TIMEOUT_S, or `timeout_s` on a RayStep.
DEFAULT_TIMEOUT_S = 300.0


def worker_timeout_s() -> float:
    """The timeout from HETPAR_WORKER_TIMEOUT_S (seconds, positive), else the default."""
    text = os.environ.get("HETPAR_WORKER_TIMEOUT_S")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise HetparError(f"HETPAR_WORKER_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return value


def _cause(error: Exception) -> str:
    """The worker's exception as one line: its type and message, never the
    'Traceback (most recent call last):' header Ray's text starts with."""
    cause = getattr(error, "cause", None)
    if cause is not None and str(cause).strip():
        return f"{type(cause).__name__}: {str(cause).strip().splitlines()[0]}"
    if cause is not None:
        return type(cause).__name__
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
    lines = [ln for ln in lines if not ln.startswith("Traceback")]
    return lines[-1] if lines else type(error).__name__


def init(address: str | None = None, num_cpus: int | None = None) -> None:
    """Joins the Ray cluster at `address`, or starts a local one on the loopback
    interface only (Ray's single-machine mode, which it reads from the environment
    when first imported)."""
    if not address:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def shutdown() -> None:
    """Stops the local Ray instance (or leaves the joined cluster) and its workers."""
    import ray

    ray.shutdown()


class RayStep:
    """A compiled step whose stages run in Ray actors. Call it with the flat arguments."""

    def __init__(self, fn: Callable, args: tuple, batch_argnum: int, plan: Plan, traced: TracedStep,
                 timeout_s: float | None = None):
        import ray

        _check_supported(traced)
        init()
        self.graph = traced.exec_graph
        self._traced, self._plan, self.timeout_s = traced, plan, timeout_s or worker_timeout_s()
        self._tasks = step_tasks(traced, plan)
        worker = ray.remote(num_cpus=0, max_restarts=0)(StageWorker)
        self.workers = {s.index: worker.remote(len(s.device_ids)) for s in plan.stages}
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.asarray(x).dtype), args)
        try:
            built = [w.build.remote(fn, abstract, batch_argnum, plan, stage) for stage, w in self.workers.items()]
        except Exception as e:  # the step could not be pickled for the workers
            self.shutdown()
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise HetparError(
                f"the train step cannot be sent to the Ray workers ({type(e).__name__}: {first.strip()[:160]}); "
                "make it a module-level function that closes over no locks, open files or connections, "
                "or use runtime='local'"
            ) from None
        try:
            self._wait(built, "building the stage programs")
        except HetparError:
            self.shutdown()  # no half-built runtime keeps processes alive
            raise
        holders = [SimpleNamespace(task=t) for t in self._tasks.tasks]
        m = self._tasks.num_microbatches
        self._order = (
            order(holders, m, plan.schedule) if plan.num_replicas == 1
            else replicated_order(holders, self._tasks.replica_of, m, plan.schedule)
        )
        self._producer: dict[tuple[int, int], int] = {}  # (value, replica) -> stage
        self._readers: dict[tuple[int, int], set[int]] = {}
        for t, r in zip(self._tasks.tasks, self._tasks.replica_of):
            for v in (*t.outputs, *t.reductions):
                self._producer[(v, r)] = t.stage
            for v in t.inputs:
                self._readers.setdefault((v, r), set()).add(t.stage)
        self._outvars = set(self.graph.outvars)

    def pids(self) -> dict[int, int]:
        import ray

        return dict(zip(self.workers, ray.get([w.pid.remote() for w in self.workers.values()], timeout=60)))

    def _leaves(self, v: int, r: int, stage: int) -> bool:
        """Whether another stage, or the caller, needs value v of replica r."""
        return bool(self._readers.get((v, r), set()) - {stage}) or (r == 0 and v in self._outvars)

    def __call__(self, flat_args: Sequence[Any]) -> list[Any]:
        import ray

        if not self.workers or not ray.is_initialized():
            raise HetparError("this step's Ray workers were shut down; call hetpar.parallelize again to start new ones")
        for w in self.workers.values():
            w.begin_step.remote()  # before any program of this step: nothing of an earlier step survives
        try:
            return self._step(flat_args)
        except BaseException:  # a failed or interrupted step leaves nothing behind either
            for w in self.workers.values():
                w.end_step.remote()
            raise

    def _step(self, flat_args: Sequence[Any]) -> list[Any]:
        import ray

        tasks, graph = self._tasks, self.graph
        inputs = dict(zip(graph.invars, flat_args))
        refs: dict[tuple, Any] = {}  # (value, microbatch, replica) -> object ref of a host array
        delivered: set[tuple] = set()  # (stage, key) whose worker holds the value
        tokens = []

        def per_mb(v: int) -> bool:
            return is_per_microbatch(graph, self._traced.analysis, set(self._traced.batch_invars), v)

        def input_ref(v: int, mb: int | None) -> Any:
            key = (v, mb, "input")
            if key not in refs:
                x = np.asarray(inputs[v])
                if mb is not None:
                    start, size = tasks.slices[mb]
                    x = x[start : start + size]
                refs[key] = ray.put(x)
            return refs[key]

        for item in self._order:
            if item.combine:
                self._combine(refs)
                continue
            t, r = tasks.tasks[item.program], tasks.replica_of[item.program]
            mb = item.microbatch
            names, arrays = [], []
            for v in t.inputs:
                key = (v, mb if per_mb(v) else None, r)
                producer = self._producer.get((v, r))
                if (t.stage, key) in delivered or producer == t.stage:
                    continue
                arrays.append(refs[key] if producer is not None else input_ref(v, key[1]))
                names.append(v)
                delivered.add((t.stage, key))
            export = tuple(v for v in t.outputs if self._leaves(v, r, t.stage))
            out_mb = mb if t.per_microbatch else None
            result = self.workers[t.stage].run.options(num_returns=len(export) + 1).remote(
                item.program, mb, r, item.last_microbatch, export, tuple(names), *arrays
            )
            result = result if export else [result]  # one return comes back as a bare ref
            refs.update({(v, out_mb, r): ref for v, ref in zip(export, result[:-1])})
            tokens.append(result[-1])
            if item.release is not None:
                for k in [k for k in refs if k[1] == item.release]:
                    del refs[k]
                for s in self._plan.replica_stages(r):
                    self.workers[s.index].release.remote(item.release)
        outputs = [self._output(v, refs, inputs) for v in graph.outvars]
        pending = [o for o in outputs if isinstance(o, ray.ObjectRef)]
        values = dict(zip(map(id, pending), self._wait(tokens + pending, "running the step")[len(tokens):]))
        for w in self.workers.values():
            w.end_step.remote()
        return [jax.numpy.asarray(values[id(o)]) if isinstance(o, ray.ObjectRef) else o for o in outputs]

    def _combine(self, refs: dict) -> None:
        """Replicas' reductions into replica 0's, then export those other stages read."""
        tasks = self._tasks
        for t, r in zip(tasks.tasks, tasks.replica_of):
            if r == 0:
                continue
            for v in t.reductions:
                other = self.workers[t.stage].export.remote((v, None, r))
                self.workers[self._producer[(v, 0)]].combine.remote(v, 0, other)
        for t, r in zip(tasks.tasks, tasks.replica_of):
            if r == 0:
                for v in t.reductions:
                    if self._leaves(v, 0, t.stage):
                        refs[(v, None, 0)] = self.workers[t.stage].export.remote((v, None, 0))

    def _output(self, v: int, refs: dict, inputs: dict) -> Any:
        if v in self.graph.constants:
            return constant_output(self._traced.full.constants[v], self.graph.avals[v])
        if (v, None, 0) in refs:
            return refs[(v, None, 0)]
        return inputs[v]

    def _wait(self, refs: list, doing: str) -> list:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise HetparError(f"{doing} did not finish within {self.timeout_s:.0f} s; a stage's worker may be stuck") from None
        except ray.exceptions.RayActorError:
            raise HetparError(f"{doing}: the worker of {self._dead()} died; start again with a new parallelize") from None
        except ray.exceptions.RayTaskError as e:
            raise HetparError(f"{doing}: a stage's worker raised {_cause(e)}") from None

    def _dead(self) -> str:
        import ray

        dead = []
        for stage, w in self.workers.items():
            try:
                ray.get(w.pid.remote(), timeout=10)
            except ray.exceptions.RayError:
                dead.append(str(stage))
        return f"stage {', '.join(dead)}" if dead else "a stage"

    def shutdown(self) -> None:
        import ray

        for w in self.workers.values():
            ray.kill(w)
        self.workers = {}


def _check_supported(traced: TracedStep) -> None:
    """The multi-process runtime does not yet hand microbatches slices of whole-batch
    values (dropout bits, see trace/whole_batch.py) nor gather per-example outputs."""
    analysis = traced.analysis
    if analysis.sliced:
        raise HetparError(
            "this step draws random bits shaped by the batch (dropout) or reads per-example values computed over "
            "the whole batch; the Ray runtime does not slice them per microbatch yet: use runtime='local'"
        )
    if any(v in analysis.batch_axis for v in traced.full.outvars):
        raise HetparError("the step returns per-example values, which the Ray runtime does not gather yet: use runtime='local'")

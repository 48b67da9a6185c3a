"""Ray as a launcher and a transport: one actor per device group, the interpreter on the driver.

The driver runs the same interpreter as every other runtime (runtime/interpreter.py)
over `RayTransport`: each instruction becomes an actor call, submitted at once and
in the schedule's order, and each value a handle (the actor that holds it and an id).
Ray starts each call when the values it needs exist, so stages in different
processes run concurrently and the driver never waits inside the step. Values cross
between actors as host arrays in Ray's object store. The driver then waits, with a
time limit, on every call's completion token and on the step's outputs: a worker
that raised or died surfaces here as a HetparError naming its stages.
"""

from __future__ import annotations

import logging
import os
from itertools import count
from typing import Any, Callable, Sequence

import jax
import numpy as np

from hetpar.compile.compiled import CompiledStep
from hetpar.compile.step import compile_step
from hetpar.errors import HetparError
from hetpar.plan import Plan
from hetpar.runtime.communicator import from_host, to_host
from hetpar.runtime.interpreter import interpret
from hetpar.runtime.ray_worker import StageWorker
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


class RayValue:
    """A value a worker holds (`actor`: the index of its device group) under `id`.
    `ref` is its host copy in Ray's object store once it has one (made once, however
    many workers read it); `delivered` says whether the worker holds it yet: a copy on
    its way arrives with the first instruction that reads it there."""

    __slots__ = ("actor", "id", "ref", "delivered")

    def __init__(self, actor: int, id: int, ref: Any = None, delivered: bool = True):
        self.actor, self.id, self.ref, self.delivered = actor, id, ref, delivered


class RayTransport:
    """The interpreter's instructions as actor calls: values are RayValues, a target
    is the actor of the program's stage (the worker lays each input out itself)."""

    frees = True

    def __init__(self, step: CompiledStep, actors: list, actor_of: dict[int, int], wait: Callable[[list, str], list]):
        self.tasks, self.fusions = step.tasks, step.fusions
        self.actors, self.actor_of, self.wait = actors, actor_of, wait
        self.targets = [(actor_of[t.stage],) * len(t.inputs) for t in step.tasks]
        self.fused_targets = {i: (actor_of[step.tasks[i].stage],) * (len(f.inputs) + len(f.post_inputs))
                              for i, f in step.fusions.items()}
        self.tokens: list = []  # one per instruction: what the driver waits on at the end
        self._ids = count()
        self._puts: dict[int, tuple] = {}  # id of a driver value -> (the value, its host copy in the object store)

    def _new(self, actor: int) -> RayValue:
        return RayValue(actor, next(self._ids))

    def _ref(self, x: Any) -> Any:
        """`x`'s host copy in the object store (a worker's value exported once; a step
        argument put once)."""
        import ray

        if isinstance(x, RayValue):
            if x.ref is None:
                x.ref = self.actors[x.actor].export.remote(x.id)
            return x.ref
        held = self._puts.get(id(x))
        if held is None:  # the value is held with its copy, so its id stays its own for the step
            held = self._puts[id(x)] = (x, ray.put(to_host(x)))
        return held[1]

    def _send(self, values: Sequence[RayValue]) -> tuple[tuple[int, ...], tuple[int, ...], list]:
        """For one instruction: the values' ids, and those not yet at its worker with their host copies."""
        arrivals, received = [], []
        for x in values:
            if not x.delivered:
                arrivals.append(x.id)
                received.append(x.ref)
                x.delivered = True
        return tuple(x.id for x in values), tuple(arrivals), received

    def move(self, x: Any, actor: int) -> RayValue:
        if isinstance(x, RayValue) and x.actor == actor:
            return x
        return RayValue(actor, next(self._ids), self._ref(x), delivered=False)

    def split(self, x: Any, pieces: tuple[tuple[int, int], ...], axis: int, actor: int) -> list[RayValue]:
        return [self.move(self._slice(x, start, size, axis), actor) for start, size in pieces]

    def _slice(self, x: Any, start: int, size: int, axis: int) -> Any:
        if not isinstance(x, RayValue):  # a step argument: sliced here, sent as the slice
            if isinstance(x, jax.Array):
                return jax.lax.slice_in_dim(x, start, start + size, axis=axis)
            return np.asarray(x)[(slice(None),) * axis + (slice(start, start + size),)]
        into = self._new(x.actor)
        (source,), arrivals, received = self._send([x])
        self.tokens.append(self.actors[x.actor].slice.remote(source, into.id, start, size, axis, arrivals, *received))
        return into

    def call(self, program: int, acc: Any, args: list, last: bool) -> tuple[list, Any]:
        task = self.tasks[program]
        actor = self.actor_of[task.stage]
        ids, arrivals, received = self._send(args)
        outs = [self._new(actor) for _ in task.outputs]
        accs = [self._new(actor) for _ in (task.reductions if last else (None,))]
        self.tokens.append(self.actors[actor].run.remote(
            program, None if acc is None else acc.id, ids, tuple(o.id for o in outs), tuple(a.id for a in accs), last,
            arrivals, *received))
        return outs, accs if last else accs[0]

    def call_fused(self, program: int, acc: Any, args: list) -> tuple[list, list, list]:
        task, folded = self.tasks[program], self.fusions[program]
        actor = self.actor_of[task.stage]
        ids, arrivals, received = self._send(args)
        outs = [self._new(actor) for _ in task.outputs]
        finals = [self._new(actor) for _ in folded.reductions]
        updated = [self._new(actor) for _ in folded.post.outputs]
        made = tuple(x.id for x in (*outs, *finals, *updated))
        self.tokens.append(self.actors[actor].run_fused.remote(
            program, None if acc is None else acc.id, ids, made, arrivals, *received))
        return outs, finals, updated

    def merge(self, how: str, home: RayValue, other: Any) -> RayValue:
        into = self._new(home.actor)  # `home` may itself be on its way there (a mixed stage's part's first share)
        (mine, theirs), arrivals, received = self._send([home, self.move(other, home.actor)])
        self.tokens.append(self.actors[home.actor].merge.remote(how, mine, theirs, into.id, arrivals, *received))
        return into

    def concatenate(self, pieces: list, axis: int) -> RayValue:
        """On the worker of the first piece."""
        actor = pieces[0].actor
        into = self._new(actor)
        ids, arrivals, received = self._send([self.move(p, actor) for p in pieces])
        self.tokens.append(self.actors[actor].concatenate.remote(ids, into.id, axis, arrivals, *received))
        return into

    def free(self, values: list) -> None:
        held: dict[int, list[int]] = {}
        for x in values:
            if x.delivered:
                held.setdefault(x.actor, []).append(x.id)
        for actor, ids in held.items():
            self.actors[actor].free.remote(tuple(ids))

    def results(self, outputs: list) -> list:
        """Waits (with the time limit) on every instruction and on the outputs, which
        come back as host arrays made into jax Arrays on the driver."""
        refs = [self._ref(x) for x in outputs if isinstance(x, RayValue)]
        values = iter(self.wait(self.tokens + refs, "running the step")[len(self.tokens):])
        return [from_host(next(values)) if isinstance(x, RayValue) else x for x in outputs]


class RayStep:
    """A compiled step whose stages run in Ray actors, one per device group (an
    interleaved plan's chunks on a group share its actor). Call it with the flat
    arguments."""

    def __init__(self, fn: Callable, args: tuple, batch_argnum: int, plan: Plan, traced: TracedStep,
                 timeout_s: float | None = None):
        import ray

        init()
        self.timeout_s = timeout_s or worker_timeout_s()
        self.step = compile_step(traced, plan, {}, {}, keep=lambda stage: False)  # the structure: no program here
        self.graph = self.step.graph
        groups: dict[tuple[int, ...], list[int]] = {}
        for s in plan.stages:
            groups.setdefault(tuple(s.device_ids), []).append(s.index)
        self._stages = list(groups.values())  # per actor, its stages
        self._actor_of = {s: a for a, stages in enumerate(self._stages) for s in stages}
        worker = ray.remote(num_cpus=0, max_restarts=0)(StageWorker)
        self._actors = [worker.remote(len(devices)) for devices in groups]
        self.workers = {s: self._actors[a] for s, a in sorted(self._actor_of.items())}  # stage -> its actor
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.asarray(x).dtype), args)
        try:
            built = [a.build.remote(fn, abstract, batch_argnum, plan, tuple(stages))
                     for a, stages in zip(self._actors, self._stages)]
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
        log.info("%d Ray workers, stages per worker: %s", len(self._actors), self._stages)

    def pids(self) -> dict[int, int]:
        """Per stage, the process id of its worker."""
        import ray

        return dict(zip(self.workers, ray.get([w.pid.remote() for w in self.workers.values()], timeout=60)))

    def __call__(self, flat_args: Sequence[Any]) -> list[Any]:
        import ray

        if not self._actors or not ray.is_initialized():
            raise HetparError("this step's Ray workers were shut down; call hetpar.parallelize again to start new ones")
        for a in self._actors:
            a.begin_step.remote()  # before any instruction of this step: nothing of an earlier step survives
        try:
            return interpret(self.step, RayTransport(self.step, self._actors, self._actor_of, self._wait), flat_args)
        finally:  # a finished, failed or interrupted step leaves nothing behind
            for a in self._actors:
                a.end_step.remote()

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
        """The stages whose worker no longer answers."""
        import ray

        dead = []
        for a, stages in zip(self._actors, self._stages):
            try:
                ray.get(a.pid.remote(), timeout=10)
            except ray.exceptions.RayError:
                dead += stages
        if not dead:
            return "a stage"
        return f"stage{'s' if len(dead) > 1 else ''} {', '.join(map(str, sorted(dead)))}"

    def shutdown(self) -> None:
        import ray

        for a in self._actors:
            ray.kill(a)
        self._actors, self.workers = [], {}

"""A compiled step: every stage program, what each value is, and the order the
schedule runs the programs in. What a runtime needs, and nothing it decides.

The structure (tasks, fused updates, order) is known everywhere; the programs only
where they run: a process or a Ray driver that runs none of a stage's programs holds
None in their place (`compile_step`'s `keep`) and still walks the same order."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import SimpleNamespace
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from hetpar.compile.order import Step, fuse_updates, order, replicated_order, with_parts
from hetpar.compile.programs import FusedProgram, Fusion, Program
from hetpar.compile.tasks import Task
from hetpar.trace.microbatch import MicrobatchAnalysis, Phase
from hetpar.trace.opgraph import OpGraph
from solver.schedules import DEFAULT


@dataclass
class CompiledStep:
    graph: OpGraph  # traced at one microbatch
    constants: dict[int, Any]  # full-batch trace constants
    analysis: MicrobatchAnalysis
    programs: list[Program | None]  # in task order; None where another process runs it
    batch_invars: set[int]
    num_microbatches: int  # per replica
    microbatch_size: int
    schedule: str = DEFAULT
    # Data-parallel replicas (several pipelines, each on part of the batch): each
    # program's replica, and each global microbatch's (start, size) in the batch.
    replica_of: tuple[int, ...] = ()
    slices: tuple[tuple[int, int], ...] = ()
    chunks: int = 1  # stages per device group (an interleaved schedule's virtual stages)
    # Per host program (a stage's last per-microbatch program): that program's last
    # microbatch with the stage's update folded in, and the post program it replaces.
    fused: dict[int, FusedProgram] = field(default_factory=dict)  # only where compiled (see `keep`)
    fused_posts: dict[int, int] = field(default_factory=dict)
    fusions: dict[int, Fusion] = field(default_factory=dict)  # per host program, compiled or not
    tasks: tuple[Task, ...] = ()  # per program (from the programs when not given)
    # Pre programs whose work runs inside a fused program (`Fusion.pre`, one
    # microbatch only): compiled, but not dispatched.
    folded_pres: frozenset[int] = frozenset()
    # JAX device id -> its kind's vendor, where the plan's stages have more than one:
    # values between two vendors' devices go through host memory (no device link
    # joins them), see runtime/communicator.HostStagedPath. Empty: one vendor.
    vendors: dict[int, str] = field(default_factory=dict)
    # Mixed-kind stages: each part's rows of a microbatch ((offset, count) by stage
    # index, lead included) and each lead's parts in row order (compile/step.mixed_rows).
    # A part's per-microbatch values are its rows only: the runtime cuts its inputs and
    # joins its outputs (runtime/interpreter.py).
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    parts: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tasks:
            self.tasks = tuple(p.task for p in self.programs)

    @property
    def num_replicas(self) -> int:
        return max(self.replica_of, default=0) + 1

    def microbatch_slice(self, mb: int) -> tuple[int, int]:
        return self.slices[mb] if self.slices else (mb * self.microbatch_size, self.microbatch_size)

    def replica_microbatches(self, replica: int) -> range:
        """The global microbatches replica `replica` runs."""
        m = self.num_microbatches
        return range(replica * m, replica * m + m) if self.replica_of else range(m)

    @cached_property
    def order(self) -> list[Step]:
        """The programs in the order the schedule dispatches them (computed once)."""
        own = [i for i, t in enumerate(self.tasks) if not (t.stage in self.rows and t.stage not in self.parts)]
        held = [SimpleNamespace(task=self.tasks[i]) for i in own]
        if self.num_replicas == 1:
            steps = fuse_updates(order(held, self.num_microbatches, self.schedule, self.chunks), self.fused_posts)
            steps = [s for s in steps if s.program not in self.folded_pres]
        else:
            steps = replicated_order(held, [self.replica_of[i] for i in own], self.num_microbatches, self.schedule, self.chunks)
        return with_parts(steps, own, self.tasks, self.parts) if self.parts else steps

    @cached_property
    def input_keys(self) -> dict[int, tuple[bool, ...]]:
        """Per program, per input: whether it is a per-microbatch value (fixed at
        compile, so the runtime does not ask per dispatch). A program with pre work
        folded into its fused form runs only that way (one microbatch): its inputs
        are the fused program's."""
        def inputs(i: int, t: Task) -> tuple[int, ...] | list[int]:
            f = self.fusions.get(i)
            return f.inputs if f is not None and f.pre is not None else t.inputs

        return {i: tuple(self.per_microbatch(v) for v in inputs(i, t)) for i, t in enumerate(self.tasks)}

    @cached_property
    def microbatch_inputs(self) -> dict[int, tuple[int, ...]]:
        """Per program, the positions of its per-microbatch inputs."""
        return {p: tuple(i for i, per_mb in enumerate(keys) if per_mb) for p, keys in self.input_keys.items()}

    def per_microbatch(self, value: int) -> bool:
        return is_per_microbatch(self.graph, self.analysis, self.batch_invars, value)

    def dispatched(self, here: Callable[[Any], bool] = lambda mesh: True) -> list[Any]:
        """The callables a step dispatches, in the order it first does, of the
        programs whose mesh `here` accepts: what must be compiled before it runs
        (a program a fused one replaces on every microbatch is not among them)."""
        out: list[Any] = []
        started: set[int] = set()  # programs whose accumulators exist by this dispatch
        for item in self.order:
            if item.combine:
                continue
            p, fused = self.programs[item.program], self.fused.get(item.program) if item.fused is not None else None
            fresh = item.program not in started  # no accumulators yet: `first`, or zeros then `fn`
            started.add(item.program)
            if fused is not None:
                if here(fused.mesh):
                    if fresh and fused.accumulates and p is not None and p.init_acc is not None:
                        out.append(p.init_acc)
                    out.append(fused.fn)
                continue
            if p is None or not here(p.mesh):
                continue
            if fresh and p.first is not None:
                out.append(p.first)
            else:
                if fresh and p.init_acc is not None:
                    out.append(p.init_acc)
                out.append(p.fn)
            if item.last_microbatch and p.finish is not None:
                out.append(p.finish)
        return list(dict.fromkeys(out))


def is_per_microbatch(graph: OpGraph, analysis: MicrobatchAnalysis, batch_invars: set[int], value: int) -> bool:
    """A batch input, a value a per-microbatch operator makes (not a reduction), or a
    whole-batch value each microbatch reads a slice of."""
    if value in batch_invars or value in analysis.sliced:
        return True
    producer = graph.producer.get(value)
    return producer is not None and analysis.phase[producer] is Phase.MICRO and value not in analysis.reductions


def constant_output(value: Any, aval: Any) -> Any:
    """A step output the trace folded to a constant, typed as `jax.jit` returns it: a
    jax array, weakly typed where the trace says so (a Python scalar result)."""
    x = np.asarray(value, dtype=aval.dtype)
    if getattr(aval, "weak_type", False) and x.ndim == 0:
        return jnp.asarray(x.item())  # from a Python scalar: weakly typed, as in jit
    return jnp.asarray(x)

"""`hetpar.parallelize`: the user's entry point.

The first call with new shapes runs the pipeline of passes (trace, analyze
microbatches, build layers, assign stages, cut tasks, compile) and caches the
result by the arguments' structure, shapes and dtypes, as `jax.jit` does.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax

from hetpar.cluster.cluster import Cluster
from hetpar.compile.programs import compile_task, stage_mesh
from hetpar.compile.tasks import build_tasks, op_stages
from hetpar.errors import HetparError, PlanError, UnsupportedStepError
from hetpar.plan import Plan
from hetpar.planning import assign_stages
from hetpar.runtime.executor import CompiledStep, run
from hetpar.trace import jaxpr_ir
from hetpar.trace.flops import op_costs
from hetpar.trace.layers import build_layers
from hetpar.trace.microbatch import analyze, check_same_structure

log = logging.getLogger("hetpar")


@dataclass(frozen=True)
class Options:
    cluster: Cluster
    num_microbatches: int = 1
    num_stages: int | None = None  # default: one per device type
    num_layers: int | None = None  # default: enough for the stages, at module boundaries
    batch_argnum: int = 1  # which positional argument is the batch


class ParallelFunction:
    """A train step that runs as a pipeline on the cluster. Call it like the step."""

    def __init__(self, fn: Callable, options: Options):
        self._fn = fn
        self._options = options
        self._cache: dict[Any, tuple[Plan, CompiledStep]] = {}
        self._last: Plan | None = None
        self._last_compiled: CompiledStep | None = None
        functools.update_wrapper(self, fn)

    @property
    def plan(self) -> Plan:
        """The plan of the most recent call."""
        if self._last is None:
            raise HetparError("no plan yet: the plan is made on the first call, from the arguments' shapes")
        return self._last

    def compiled(self) -> CompiledStep:
        """The compiled step of the most recent call (for the predictor and benchmarks)."""
        if self._last is None:
            raise HetparError("nothing compiled yet: compilation happens on the first call")
        return self._last_compiled

    def cache_size(self) -> int:
        """How many argument shapes this function has been planned and compiled for."""
        return len(self._cache)

    def __call__(self, *args: Any) -> Any:
        flat, treedef = jax.tree.flatten(args)
        key = (treedef, tuple((tuple(x.shape), str(x.dtype)) for x in map(_aval, flat)))
        if key not in self._cache:
            self._cache[key] = self._build(args)
        plan, compiled = self._cache[key]
        self._last, self._last_compiled = plan, compiled
        return jax.tree.unflatten(compiled.graph.out_tree, run(compiled, flat))

    def _build(self, args: tuple) -> tuple[Plan, CompiledStep]:
        o = self._options
        batch_size, batch_leaves = _batch_size(args, o.batch_argnum, o.num_microbatches)
        mb = batch_size // o.num_microbatches
        timer = _Timer()

        with timer("trace"):
            full = jaxpr_ir.trace(self._fn, *_at_batch(args, o.batch_argnum, batch_size))
            probe = jaxpr_ir.trace(self._fn, *_at_batch(args, o.batch_argnum, 2 * batch_size))
            exec_graph = full if mb == batch_size else jaxpr_ir.trace(self._fn, *_at_batch(args, o.batch_argnum, mb))
        batch_invars = [full.invars[i] for i in batch_leaves]
        with timer("analyze"):
            analysis = analyze(full, probe, batch_invars)
            if exec_graph is not full:
                _check_microbatch_program(full, exec_graph, mb)
        num_stages = o.num_stages or min(len(o.cluster.groups), o.cluster.num_devices)
        with timer("layers"):
            costs = [c.flops for c in op_costs(full)]
            layers = build_layers(full, analysis, costs, o.num_layers or num_stages)
        with timer("plan"):
            # A cluster read from a file names device types only: run it on this process's devices.
            cluster = o.cluster if all(g.device_ids for g in o.cluster.groups) else o.cluster.bind()
            plan = assign_stages(layers, cluster, num_stages, o.num_microbatches)
        with timer("compile"):
            layer_stage = [s.index for s in plan.stages for _ in range(s.layer_start, s.layer_end)]
            stages = op_stages(full, analysis, layers, layer_stage)
            tasks = build_tasks(full, analysis, stages)
            meshes = {s.index: stage_mesh(s.device_ids) for s in plan.stages}
            programs = [compile_task(t, exec_graph, full.constants, analysis, meshes[t.stage], o.num_microbatches) for t in tasks]
        log.info("hetpar built a %d-stage plan in %s", plan.num_stages, timer)
        compiled = CompiledStep(exec_graph, full.constants, analysis, programs, set(batch_invars), o.num_microbatches, mb)
        return plan, compiled


def parallelize(
    fn: Callable | None = None,
    *,
    cluster: Cluster,
    num_microbatches: int = 1,
    num_stages: int | None = None,
    num_layers: int | None = None,
    batch_argnum: int = 1,
) -> Any:
    """Parallelizes a train step `fn(state, batch)` over `cluster`.

    Use as `parallelize(step, cluster=...)` or as a decorator
    `@parallelize(cluster=...)`. The result computes what `jax.jit(fn)` computes.
    """
    if num_microbatches < 1:
        raise PlanError(f"num_microbatches must be at least 1, got {num_microbatches}")
    options = Options(cluster, num_microbatches, num_stages, num_layers, batch_argnum)
    if fn is None:
        return lambda f: ParallelFunction(f, options)
    return ParallelFunction(fn, options)


def _check_microbatch_program(full: Any, microbatch: Any, size: int) -> None:
    try:
        check_same_structure(full, microbatch)
    except UnsupportedStepError:
        hint = (
            " JAX traces size-1 dimensions differently (broadcasting), so microbatches of one example "
            "do not line up with the full batch: use fewer microbatches or a larger batch."
            if size == 1 else ""
        )
        raise UnsupportedStepError(
            f"the step traces to a different program at the microbatch size {size} than at the full batch.{hint}"
        ) from None


def _aval(x: Any) -> Any:
    return x if hasattr(x, "shape") else jax.numpy.asarray(x)


def _batch_size(args: tuple, batch_argnum: int, num_microbatches: int) -> tuple[int, list[int]]:
    """The batch size and the flat indices of the batch's leaves."""
    if batch_argnum >= len(args):
        raise HetparError(f"the step got {len(args)} arguments; batch_argnum={batch_argnum} names none of them")
    before = sum(len(jax.tree.leaves(a)) for a in args[:batch_argnum])
    leaves = jax.tree.leaves(args[batch_argnum])
    if not leaves:
        raise HetparError("the batch argument has no arrays")
    sizes = {int(_aval(x).shape[0]) if _aval(x).ndim else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise HetparError(f"every leaf of the batch needs the same leading batch dimension; got sizes {sorted(map(str, sizes))}")
    (size,) = sizes
    if size % num_microbatches:
        raise PlanError(
            f"batch size {size} is not divisible by num_microbatches={num_microbatches}; "
            f"pick a microbatch count that divides it (e.g. {_divisor_near(size, num_microbatches)})"
        )
    return size, list(range(before, before + len(leaves)))


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), d))


def _at_batch(args: tuple, batch_argnum: int, size: int) -> tuple:
    """Abstract arguments with the batch's leading dimension set to `size`."""
    def spec(x: Any, batch: bool) -> jax.ShapeDtypeStruct:
        x = _aval(x)
        shape = (size, *x.shape[1:]) if batch else x.shape
        return jax.ShapeDtypeStruct(shape, x.dtype)

    return tuple(
        jax.tree.map(functools.partial(spec, batch=i == batch_argnum), a) for i, a in enumerate(args)
    )


class _Timer:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def __call__(self, name: str) -> "_Timer":
        self._name = name
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.times[self._name] = time.perf_counter() - self._start

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.2f}s" for k, v in self.times.items())

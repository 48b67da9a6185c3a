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
from hetpar.compile.programs import stage_mesh
from hetpar.compile.step import compile_step
from hetpar.errors import HetparError, PlanError
from hetpar.plan import Plan
from hetpar.planning import assign_stages
from hetpar.runtime.executor import CompiledStep, run
from hetpar.trace.flops import op_costs
from hetpar.trace.layers import build_layers
from hetpar.trace.traced_step import as_array, trace_step

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
        key = (treedef, tuple((tuple(x.shape), str(x.dtype)) for x in map(as_array, flat)))
        if key not in self._cache:
            self._cache[key] = self._build(args)
        plan, compiled = self._cache[key]
        self._last, self._last_compiled = plan, compiled
        return jax.tree.unflatten(compiled.graph.out_tree, run(compiled, flat))

    def _build(self, args: tuple) -> tuple[Plan, CompiledStep]:
        o = self._options
        timer = _Timer()
        with timer("trace"):
            traced = trace_step(self._fn, args, o.batch_argnum, o.num_microbatches)
        num_stages = o.num_stages or min(len(o.cluster.groups), o.cluster.num_devices)
        with timer("layers"):
            costs = [c.flops for c in op_costs(traced.full)]
            layers = build_layers(traced.full, traced.analysis, costs, o.num_layers or num_stages)
        with timer("plan"):
            # A cluster read from a file names device types only: run it on this process's devices.
            cluster = o.cluster if all(g.device_ids for g in o.cluster.groups) else o.cluster.bind()
            plan = assign_stages(layers, cluster, num_stages, o.num_microbatches)
        with timer("compile"):
            layer_stage = [s.index for s in plan.stages for _ in range(s.layer_start, s.layer_end)]
            meshes = {s.index: stage_mesh(s.device_ids) for s in plan.stages}
            compiled = compile_step(traced, layers, layer_stage, meshes)
        log.info("hetpar built a %d-stage plan in %s", plan.num_stages, timer)
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

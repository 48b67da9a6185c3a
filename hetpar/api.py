"""`hetpar.parallelize`: the user's entry point.

The first call with new shapes runs the pipeline of passes (trace; layers, stage
assignment, sharding and placement, which make the Plan; compile, which reads only
the Plan) and caches the result by the arguments' structure, shapes and dtypes, as
`jax.jit` does.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import jax

from hetpar.arguments import check_arguments, check_step
from hetpar.cluster.cluster import Cluster, jax_devices
from hetpar.compile.compiled import CompiledStep
from hetpar.compile.cache import enable_compilation_cache
from hetpar.compile.once import compile_programs
from hetpar.compile.programs import stage_mesh
from hetpar.compile.step import compile_step, microbatch_graphs
from hetpar.errors import HetparError
from hetpar.options import RuntimeOption, ShardingOption, StageOption, build_options
from hetpar.outputs import like_options, place_metrics, several_metrics
from hetpar.plan import Plan
from hetpar.plan.file import load_plan
from hetpar.plan.like import like_plan
from hetpar.pipeline import check_fits, cluster_for, price_like, solve
from hetpar.runtime.distributed import (DistributedStep, check_cross_process, cross_process_collectives, is_multiprocess,
                                        share_plan, stages_of_process)
from hetpar.runtime.identity import check_same_run, run_identity
from hetpar.runtime.executor import RunStats, StateCopies, run
from hetpar.runtime.nvme_store import NvmeStore
from hetpar.runtime.nvme_tier import NvmeRun, has_handles, nvme_values, readable
from hetpar.runtime.ray_runtime import RayStep
from hetpar.runtime.remote import has_local_devices
from hetpar.signature import bind_call, free_donated, is_array, normalize_argnums
from hetpar.trace.traced_step import as_array, trace_step

log = logging.getLogger("hetpar")


@dataclass(frozen=True)
class Options:
    """Everything `parallelize` was told, one option object per pass."""

    cluster: Cluster | None
    plan: Plan | None  # a plan made earlier (e.g. `hetpar solve`), used as it is
    num_microbatches: int
    batch_argnum: int  # which positional argument is the batch
    stage: StageOption
    sharding: ShardingOption
    runtime: RuntimeOption
    static_argnums: tuple[int, ...] = ()  # as jax.jit (hetpar/signature.py)
    donate_argnums: tuple[int, ...] = ()  # freed after a successful step (hetpar/signature.py)
    like: Any = None  # `like=train_step`: run where that step's parameters lie (hetpar/plan/like.py)


class ParallelFunction:
    """A train step that runs as a pipeline on the cluster. Call it like the step."""

    def __init__(self, fn: Callable, options: Options):
        self._fn = check_step(fn)
        self._options = options
        self._cache: dict[Any, tuple[Plan, CompiledStep | RayStep | DistributedStep]] = {}
        self._metrics: dict[Any, bool] = {}  # per cache key: whether place_metrics has work to do
        self._last: Plan | None = None
        self._last_compiled: CompiledStep | RayStep | DistributedStep | None = None
        self._nvme: dict[Any, frozenset[int]] = {}  # per cache key with NVMe-tier stages: the values kept on disk
        self._nvme_store: NvmeStore | None = None  # one per function: every plan's NVMe state, one generation a step
        self._kept: dict[Any, StateCopies] = {}  # per cache key: its parts' and replicas' state copies between calls
        functools.update_wrapper(self, fn)

    @property
    def plan(self) -> Plan:
        """The plan of the most recent call."""
        if self._last is None:
            raise HetparError("no plan yet: the plan is made on the first call, from the arguments' shapes")
        return self._last

    def compiled(self) -> CompiledStep | RayStep | DistributedStep:
        """The compiled step of the most recent call (for the predictor and benchmarks)."""
        if self._last is None:
            raise HetparError("nothing compiled yet: compilation happens on the first call")
        return self._last_compiled

    def cache_size(self) -> int:
        """How many argument shapes this function has been planned and compiled for."""
        return len(self._cache)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_with_stats(*args, stats=None, **kwargs)

    def call_with_stats(self, *args: Any, stats: RunStats | None = None, **kwargs: Any) -> Any:
        """A call that also records, in `stats`, what the runtime holds at its peak."""
        o = self._options
        call = bind_call(self._fn, args, kwargs, o.batch_argnum, o.static_argnums, o.donate_argnums)
        flat, treedef = call.leaves, call.treedef
        key = (call.static_key, treedef, tuple(map(_shape_key, flat)))
        if key not in self._cache:
            args = call.args
            if has_handles(flat):  # NVMe-tier state of another shape's step: the tracer needs arrays
                args = jax.tree.unflatten(treedef, readable(flat))
            self._cache[key] = self._same_step_like(key) or self._build(args, call.fn, call.batch_argnum)
            graph = self._cache[key][1].graph
            self._metrics[key] = several_metrics(graph.avals[v] for v in graph.outvars)
            self._nvme_outputs(key)
        plan, compiled = self._cache[key]
        self._last, self._last_compiled = plan, compiled
        if isinstance(compiled, RayStep):
            outputs = compiled(flat)
        elif isinstance(compiled, DistributedStep):
            outputs = compiled(flat, stats)
        elif key in self._nvme or has_handles(flat):  # state to and from the NVMe tier's files, handles in its place
            outputs = run(compiled, flat, stats, NvmeRun(compiled, self._nvme.get(key, frozenset()), self._nvme_store))
        else:
            outputs = run(compiled, flat, stats, kept=self._kept.setdefault(key, StateCopies()) if compiled.parts or compiled.replica_of else None)
        result = jax.tree.unflatten(compiled.graph.out_tree, outputs)
        if self._metrics[key]:
            result = place_metrics(result)
        free_donated(call.donated, result, call.kept)
        return result

    def _nvme_outputs(self, key: Any) -> None:
        """Notes which outputs of the plan cached at `key` go to the NVMe tier's store
        (runtime/nvme_tier.py); refuses runtimes it does not serve."""
        plan, compiled = self._cache[key]
        values = nvme_values(plan)
        if not values:
            return
        if isinstance(compiled, RayStep | DistributedStep):
            raise HetparError("offload='nvme' keeps state in this process's file store, which the Ray and "
                              "jax.distributed runtimes do not serve yet: use offload='host' there")
        if self._nvme_store is None:
            folder = self._options.runtime.nvme_dir
            self._nvme_store = NvmeStore(folder) if folder else NvmeStore.temporary()
            log.info("hetpar keeps NVMe-tier optimizer state in %s", self._nvme_store.root)
        self._nvme[key] = values

    @property
    def nvme_store(self) -> NvmeStore | None:
        """The NVMe tier's file store of this function (None until a plan uses it)."""
        return self._nvme_store

    def shutdown(self) -> None:
        """Stops the workers of a Ray runtime (nothing to do in-process)."""
        for _, compiled in self._cache.values():
            if isinstance(compiled, RayStep):
                compiled.shutdown()
        self._cache.clear()
        self._metrics.clear()
        self._kept.clear()

    def _same_step_like(self, key: Any) -> tuple[Plan, CompiledStep | RayStep | DistributedStep] | None:
        """`parallelize(step, like=train)` where `step` is train's own function, called
        the same way with arguments of the same types: train's plan and programs, as
        `jax.jit` reuses its executable for the same function; nothing is compiled."""
        like, o = self._options.like, self._options
        if like is None or like._fn is not self._fn or key not in like._cache:
            return None
        lo = like._options
        if (lo.batch_argnum, lo.static_argnums) != (o.batch_argnum, o.static_argnums):
            return None
        return like._cache[key]

    def _build(self, args: tuple, fn: Callable, batch_argnum: int) -> tuple[Plan, CompiledStep | RayStep | DistributedStep]:
        """The passes, in order: trace, plan (or check a given plan), compile."""
        o = self._options
        timer = _Timer()
        microbatches = o.plan.num_microbatches if o.plan else o.num_microbatches
        with timer("trace"):
            traced = trace_step(fn, args, batch_argnum, microbatches)
        # A cluster read from a file names device types only: run it on this process's devices.
        if o.cluster is None:
            cluster = cluster_for(o.plan)
        else:
            cluster = o.cluster if all(g.device_ids for g in o.cluster.groups) else o.cluster.bind()
        distributed = o.runtime.runtime == "distributed" or (o.runtime.runtime == "local" and is_multiprocess())
        with timer("plan"):
            placed, given = None, o.plan
            if o.like is not None and o.like._last is not None:
                given, placed = like_plan(traced, o.like.plan, args, cluster)
            if placed is not None:
                plan = price_like(traced, placed, cluster)
            elif given is not None:
                check_fits(given, traced, cluster)
                plan = given
            else:
                stage = o.stage
                # Several processes: process 0 solves, the others receive its plan.
                plan = share_plan(lambda: solve(traced, cluster, stage, o.sharding)) if distributed else (
                    solve(traced, cluster, stage, o.sharding))
        if o.runtime.runtime == "ray":
            with timer("start workers"):
                compiled = RayStep(fn, args, batch_argnum, plan, traced, o.runtime.timeout_s)
            log.info("hetpar built a %d-stage plan on Ray in %s", plan.num_stages, timer)
            return plan, compiled
        with timer("compile"):
            order = [d for g in cluster.groups for d in g.device_ids]  # plans name devices by position
            meshes = {s.index: stage_mesh(tuple(order[p] for p in s.device_ids), s.mesh_shape, s.zero_group) for s in plan.stages}
            graphs = microbatch_graphs(fn, args, batch_argnum, traced, plan)
            compiled = compile_step(traced, plan, meshes, graphs)
            # Every program the step dispatches, compiled now (once, for the plan's
            # argument types: hetpar/compile/once.py), one log line each.
            compile_programs(compiled.dispatched(lambda mesh: has_local_devices(mesh.devices.flat)))
        if distributed:
            devices = jax_devices(tuple(order))
            check_cross_process(plan, devices, cross_process_collectives())
            check_same_run(run_identity(plan, traced))
            compiled = DistributedStep(compiled, stages_of_process(plan, devices, jax.process_index()))
        log.info("hetpar built a %d-stage plan in %s", plan.num_stages, timer)
        return plan, compiled


def _shape_key(x: Any) -> tuple:
    """An argument's part of the cache key: shape and dtype (read from arrays as they
    are; only Python scalars are made into arrays to learn theirs). Runs per leaf per
    call: a jax Array's aval holds both, a tuple already."""
    if is_array(x):
        return x.shape, x.dtype
    if not hasattr(x, "dtype"):
        x = as_array(x)
    return tuple(x.shape), x.dtype


def parallelize(
    fn: Callable | None = None,
    *,
    cluster: Cluster | None = None,
    plan: Plan | str | None = None,
    num_microbatches: int = 1,
    batch_argnum: int = 1,
    stage_option: StageOption | None = None,
    sharding_option: ShardingOption | None = None,
    runtime_option: RuntimeOption | None = None,
    num_stages: int | None = None,
    num_layers: int | None = None,
    schedule: str | None = None,
    chunks: int | None = None,
    num_replicas: int | None = None,
    runtime: str | None = None,
    mesh_shape: tuple | None = None,
    static_argnums: int | tuple[int, ...] | None = None,
    donate_argnums: int | tuple[int, ...] | None = None,
    like: ParallelFunction | None = None,
    profile: str | Path | None = None,
) -> Any:
    """Parallelizes a train step `fn(state, batch)` over `cluster`.

    Use as `parallelize(step, cluster=...)` or as a decorator
    `@parallelize(cluster=...)`. With `plan=` (a Plan or a plan file from `hetpar
    solve`) the plan is used exactly as it is, on its own cluster unless `cluster` is
    given, after checking that it was made for this step. Otherwise the planning
    passes make one, as the option objects say (`hetpar.StageOption`,
    `hetpar.ShardingOption`, `hetpar.RuntimeOption`); the keyword shortcuts set their
    most used fields:

    - `num_stages`, `num_replicas`: fix the pipeline (layers split by speed; with
      `num_replicas` > 1, that many data-parallel pipelines, each taking a share of
      the batch in proportion to its speed); without them the planner decides;
    - `num_layers`, `schedule`: the layer count and a schedule of
      `solver.schedules.names()`; `chunks`: stages per device group under an
      interleaved schedule (`num_stages` device groups hold `chunks` stages each);
    - `mesh_shape=(data, model)` (or one per stage): every stage's devices form that
      2-D mesh, its operators sharded over it by the intra-op ILP; `(data, model,
      model2)`: a 3-axis mesh, where a matmul may be split over all three (3D tensor
      parallelism). Without `mesh_shape` the sharding pass chooses each stage's mesh,
      a model axis of 4 or more also as two where the ILP prices that cheaper
      (`ShardingOption.factor_model_axis=True` lets it factor a given `(data, model)`);
    - `profile`: a `hetpar profile` file whose measured figures (device kinds, and with
      `--layers` each distinct layer's times) price the plan where they apply: they
      change which plan is chosen and its predicted figures, never how a plan runs;
    - `runtime="ray"`: every device group (its stages, and their chunks) in its own Ray
      actor (see `hetpar.init`).

    The result computes what `jax.jit(fn)` computes, and is called like it: keyword
    arguments, `static_argnums` and `donate_argnums` as in `jax.jit` (donated buffers
    are freed after a successful step; see hetpar/signature.py). With
    `like=train_step`, an eval or predict function runs forward-only on the stages
    where the step's parameters already lie, in their layout there, so nothing is
    moved between train and eval (hetpar/plan/like.py; a step with data-parallel
    replicas or interleaved chunks, or one that has not run yet, gets the same
    cluster and options, planned anew). `like=` the train step itself reuses its plan
    (and, for the same function called the same way, its compiled programs); another
    function with a backward is planned anew. See hetpar/outputs.py for what a step
    returns and when `hetpar.gather` is needed.

    Each stage program is compiled once, for the plan's argument types, before the
    first step runs (a log line each on `hetpar.compile`); later calls with the state
    a step returned or one restored from a checkpoint compile nothing. JAX's
    persistent compilation cache is turned on unless the user chose otherwise
    (hetpar/compile/cache.py: `HETPAR_COMPILATION_CACHE`).
    """
    enable_compilation_cache()  # JAX's persistent cache, on unless the user chose (hetpar/compile/cache.py)
    if like is not None:
        like_opts = replace(like_options(like._options, batch_argnum, static_argnums, donate_argnums), like=like)
        return ParallelFunction(fn, like_opts) if fn else (lambda f: ParallelFunction(f, like_opts))
    a = check_arguments(fn, cluster, plan, num_microbatches=num_microbatches, num_stages=num_stages, num_layers=num_layers,
                        num_replicas=num_replicas, batch_argnum=batch_argnum, schedule=schedule, runtime=runtime,
                        mesh_shape=mesh_shape)  # hetpar/arguments.py: types and ranges, numpy ints, a cluster file path
    cluster, num_microbatches, num_stages, num_layers, num_replicas, batch_argnum, mesh_shape = (
        a.cluster, a.num_microbatches, a.num_stages, a.num_layers, a.num_replicas, a.batch_argnum, a.mesh_shape)
    if isinstance(plan, str | Path):
        plan = load_plan(plan)
    if plan is None and cluster is None:
        raise HetparError("parallelize needs a cluster (hetpar.Cluster.virtual/local/from_file) or a plan")
    stage, sharding, runtime_opt = build_options(
        stage_option, sharding_option, runtime_option, num_stages=num_stages, num_replicas=num_replicas,
        num_layers=num_layers, schedule=schedule, chunks=chunks, mesh_shape=mesh_shape, runtime=runtime,
        profile=str(profile) if profile is not None else None,
    )
    options = Options(cluster=cluster, plan=plan, num_microbatches=num_microbatches, batch_argnum=batch_argnum,
                      stage=stage, sharding=sharding, runtime=runtime_opt,
                      static_argnums=normalize_argnums(static_argnums, "static_argnums"),
                      donate_argnums=normalize_argnums(donate_argnums, "donate_argnums"))
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

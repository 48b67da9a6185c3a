"""Layer profiles at tensor-parallel degrees above 1: each layer sharded as a plan's stage would be.

At tensor-parallel degree 1 a layer alone needs no layouts: its mesh is data parallel
and compile splits the batch over it. On a `data` x `model` mesh what a layer costs
depends on how its matmuls and weights are split over the model axis and on the
collectives XLA inserts for that split; a split written by hand for the profiler
would time some other program than the one a plan runs. So the profiler asks the
project's own sharding pass (`hetpar.shard.shard_stages`: the intra-op ILP of
`solver.intra_op`, which `hetpar.pipeline.solve` runs for every plan) to lay out a plan
whose stages are the profiled layers (`layer_plan`: each layer a stage, or the
reference stage's run of layers), each on a mesh of the profiled degrees, and compiles
them with the layouts it wrote (`compile_layer_stages(layouts=...)`), as `compile_step`
compiles a plan's stages with `stage_layouts`. ZeRO is off (`ShardingOption(zero=0)`),
as at tp 1: the estimator prices a ZeRO stage's collectives apart.

The pass is handed in by the caller (`shard=hetpar.shard.shard_stages`: the CLI, the
accuracy benchmark, tests): hetpar.predict and hetpar.shard are passes that do not know
each other (pyproject's `passes-independent` contract), as the runtime's host-cost runs
are handed in (`layer_timing(host=...)`).

`Pooled` holds the layer timings of several tensor-parallel degrees (each
`LayerTiming` keys its meshes by data-parallel degree) and times them as one
interleaved pool, so that every degree's programs see the same moments of a shared host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hetpar.cluster.catalog import catalog
from hetpar.compile.step import stage_layouts
from hetpar.errors import HetparError
from hetpar.options import ShardingOption
from hetpar.plan import Plan, StagePlan
from hetpar.plan.model import runs
from hetpar.trace.layers import Layers
from hetpar.trace.stages import op_stages
from hetpar.trace.traced_step import TracedStep


def layer_plan(traced: TracedStep, layers: Layers, layer_stage: list[int], device_ids: Sequence[int],
               shape: tuple[int, int], device_kind: str) -> Plan:
    """A plan of the profiled step with layer i on stage `layer_stage[i]` (stages
    numbered from 0, each a contiguous run of layers), every stage on the same mesh
    of `device_ids` shaped `shape` (data, model): what the sharding pass needs to
    lay out each stage as it would lay out a plan's (its operators, `operator_stages`;
    its mesh). Unpriced: no cost inputs, so the pass prices matmuls at the catalog's
    figures for `device_kind`, as it does a plan without them."""
    if device_kind not in catalog():
        raise HetparError(f"cannot shard layers for {device_kind!r} devices: the sharding pass prices them from the "
                          f"catalog; profile under a catalog name (--device-type, `hetpar devices` lists them)")
    dp, tp = shape
    stages = []
    for index in sorted(set(layer_stage)):
        held = [layer for layer, s in enumerate(layer_stage) if s == index]
        stages.append(StagePlan(index, device_kind, tuple(device_ids), held[0], held[-1] + 1,
                                ", ".join(layers.names[held[0]: held[-1] + 1]), 0.0, 0.0, 0.0, mesh_shape=(dp, tp),
                                data_parallel=dp, tensor_parallel=tp))
    return Plan(tuple(stages), traced.batch_size // traced.microbatch_size, layers.num_layers,
                f"{len(device_ids)}x{device_kind}",
                operator_stages=(runs(op_stages(traced.full, traced.analysis, layers, layer_stage)),))


def layer_layouts(traced: TracedStep, layers: Layers, layer_stage: list[int], device_ids: Sequence[int],
                  shape: tuple[int, int], device_kind: str, shard: Callable[..., Plan] | None) -> dict[int, dict] | None:
    """Per stage of `layer_plan`, the layouts compile applies (`stage_layouts`), as
    the sharding pass `shard` (`hetpar.shard.shard_stages`) lays them out; None on a
    mesh without a model axis (nothing to lay out: the batch is split as at any dp)."""
    if math.prod(shape[1:]) == 1:
        return None
    if shard is None:
        raise HetparError(f"profiling layers at tensor-parallel degree {shape[1]} needs the sharding pass: pass "
                          "shard=hetpar.shard.shard_stages to layer_timing (the CLI does)")
    plan = layer_plan(traced, layers, layer_stage, device_ids, shape, device_kind)
    return stage_layouts(shard(traced, layers, plan, ShardingOption(zero=0)))


@dataclass
class Pooled:
    """The `LayerTiming`s of several tensor-parallel degrees (one each) as one pool of
    runs, with `LayerTiming`'s interface (`runs`, `records`, `measure`): a benchmark
    times `runs` in its own rounds and hands the times to `records`."""

    parts: list[Any]  # LayerTiming, one per tensor-parallel degree

    @property
    def runs(self) -> list[Callable[[], Any]]:
        return [run for part in self.parts for run in part.runs]

    @property
    def layers(self) -> list[Any]:
        return [layer for part in self.parts for layer in part.layers]

    @property
    def platform(self) -> str:
        return self.parts[0].platform

    def measure(self, rounds: int = 7) -> list[Any]:
        """Every part's runs timed in one interleaved pool (`timing.median_times`)."""
        from hetpar.predict.timing import busy_clock, median_times

        return self.records(median_times(self.runs, rounds=rounds, clock=busy_clock(self.platform)))

    def records(self, times: Sequence[float]) -> list[Any]:
        """The records of every part, from one time per run of `runs` (in order)."""
        if len(times) != len(self.runs):
            raise HetparError(f"{len(times)} times for {len(self.runs)} layer runs")
        out, at = [], 0
        for part in self.parts:
            out += part.records(times[at: at + len(part.runs)])
            at += len(part.runs)
        return out

"""Measured layer profiles: each distinct layer of a traced step timed on real devices.

The operator roofline (predict/compute.py, `solver.cost.stage_costs`) prices a layer
from its FLOPs and bytes; what a device really does with it (kernel choice, unfused
elementwise work, the precision XLA picks, dispatch) it can only guess. So
`hetpar profile --layers STEP` runs each distinct layer of the step on the local
devices, alone (each layer its own pipeline stage, `compile_layer_stages`): its
forward program, its backward program with and without recomputation, and its
once-per-step programs (the update; on a mesh of several devices the gradient
reduction too), at several microbatch sizes, data- and tensor-parallel degrees, and records
time and peak memory. Planning then prices each layer it finds in the profile from
the measurement (`solver.cost.measured`) and every other one from the model.

A record is keyed by:
- `signature`: a hash of the layer's operators (forward and backward), their operand
  and result shapes and dtypes, with the batch dimension left out, so that identical
  blocks share one record and a record fits the layer at any batch size;
- `device_kind`: the catalog name of the devices it was measured on;
- `dtype`: the step's dtype policy: its compute dtype, and for float32 the matmul
  precision it ran under where not JAX's default (`dtype_policy`);
- `tp` and `dp`: the tensor- and data-parallel degrees of the mesh (at tp > 1 the
  layer runs as the sharding pass lays out a stage of it: `tp_profile`);
and holds one point per microbatch size (`examples`: per data-parallel device).

Times are seconds of `timing.busy_clock()` (wall time on accelerators; on CPU virtual
devices the process's CPU time, all the mesh's devices' work: `shared_host`), the
median of interleaved rounds (`timing.median_times`). Besides the layers, per mesh:
one more program's cost (`stage_program_s`: the first layers one program each
against all of them as one stage that is not the last, a forward and a backward
program, which the estimator charges per stage program; a near-empty program's
launch, `program_s`, misses most of it on CPU devices, where every program wakes and
parks the devices' threads) and the replica combine of each layer's gradients
(`merge_s`); per point, the layer's input arriving from another mesh of as many
devices (`send_s`: on CPU devices a copy per shard and a dispatch, what a pipeline
pays per microbatch and cut, each way). The last layer's forward and backward are
one program (hetpar.compile.tasks), split between the two by FLOPs; so are a last
stage's, which XLA fuses across (the backward's residuals never leave the program):
`fused_s` is what a layer costs inside such a program, measured for the last layer
and the one before it (it and the last as one program, less the last alone).
Peak memory is XLA's `memory_analysis()` of the layer's largest program (arguments +
outputs + temporaries - aliased), per device. With the runtime's host-cost runs
(`layer_timing(host=hetpar.runtime.host_cost.host_runs)`, as `hetpar profile
--layers` passes them), per mesh also what the runtime itself costs the host, timed on
the reference step (two stages on the mesh, two microbatches): its interpreter's work
per program it dispatches (`dispatch_s`, the schedule walked over calls that hand back
recorded results) and cutting the batch into microbatches once (`split_s`, per point).

The JSON is part of a `hetpar profile` file (`Profile.layers`, predict/profile.py).
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import jax

from hetpar.errors import HetparError
from hetpar.predict.tp_profile import Pooled, layer_layouts
from solver.cost.measured import LayerPoint, MeasuredLayer

log = logging.getLogger("hetpar.profile")


@dataclass(frozen=True)
class LayerPointRecord:
    """One microbatch size of one layer, as measured."""

    examples: int  # per data-parallel device, per microbatch
    forward_s: float
    backward_s: float
    backward_remat_s: float = -1.0  # < 0: recomputation not measured
    # The layer's once-per-step programs: its update, and at dp > 1 its gradient sums reduced over the data
    # axis (`_finish_run`: that work without its own launch, as a step runs it inside the update program).
    once_s: float = 0.0
    peak_bytes: int = 0  # per device, the layer's largest program
    send_s: float = 0.0  # one microbatch's layer input moved here from another mesh of as many devices; 0: not measured
    stage_program_s: float = 0.0  # one more per-microbatch program's cost on the mesh at this size; 0: not measured
    # The layer's forward and backward as one program, as the pipeline's last stage runs them (with one
    # program's cost, as `forward_s` has it): XLA fuses across the two, and the backward's residuals never
    # leave the program. 0: not measured (the last layer's, and the one before it where the model has one).
    fused_s: float = 0.0
    # The runtime cutting the step's batch arguments into microbatches on this mesh, all of them once:
    # what a pipeline pays once per step (`hetpar.runtime.host_cost`). 0: not measured.
    split_s: float = 0.0


@dataclass
class LayerRecord:
    signature: str
    name: str  # the layer's modules, for people (e.g. "Block_0")
    device_kind: str
    dtype: str
    tp: int
    dp: int
    shared_host: bool
    points: list[LayerPointRecord] = field(default_factory=list)
    program_s: float = 0.0  # one near-empty program's launch on the same mesh, timed with the layers
    once_programs: int = 0  # how many programs `once_s` adds up
    merge_s: float = 0.0  # one replica's gradients of the layer added into another's (`_merge_run`); 0: not measured
    stage_program_s: float = 0.0  # one more per-microbatch program's cost on the mesh (`LayerTiming.records`); 0: not measured
    # The runtime's own host work per program it dispatches (the interpreter's walk of the schedule, each
    # program's inputs looked up and checked where they lie), beyond the program's cost: measured by
    # interpreting a step whose calls hand back recorded results (`hetpar.runtime.host_cost`). 0: not measured.
    dispatch_s: float = 0.0

    @property
    def key(self) -> tuple[str, str, str, int, int]:
        return (self.signature, self.device_kind, self.dtype, self.tp, self.dp)

    @staticmethod
    def from_dict(raw: dict) -> "LayerRecord":
        raw = dict(raw)
        raw["points"] = [LayerPointRecord(**p) for p in raw.get("points", ())]
        return LayerRecord(**raw)


def dtype_policy(compute_dtype: str) -> str:
    """The key a record's times hold for: the compute dtype, and for float32 the
    matmul precision when `jax_default_matmul_precision` asks for full float32
    (times under TF32 and under float32 differ several times on Ampere and later)."""
    from hetpar.cluster.catalog import float32_matmul_key

    return "float32/highest" if compute_dtype == "float32" and float32_matmul_key() == "fp32" else compute_dtype


def _type(aval: Any, axis: int | None) -> str:
    dims = [("B" if i == axis else str(d)) for i, d in enumerate(getattr(aval, "shape", ()))]
    return f"{getattr(aval, 'dtype', type(aval).__name__)}[{','.join(dims)}]"


def layer_signatures(graph: Any, analysis: Any, layers: Any) -> list[str]:
    """Each layer's signature: a hash of its operators with their operand and result
    types, the batch dimension written `B`, in sorted order, not program order: JAX 0.11.2
    and 0.12 trace a Llama block's backward with two gradient sums in another order, and
    a profile made under one matched only the embedding under the other."""
    axes = analysis.batch_axis
    lines: list[list[str]] = [[] for _ in range(layers.num_layers)]
    for index, layer in layers.op_layer.items():
        op = graph.ops[index]
        ins = ";".join(_type(graph.avals[v], axes.get(v)) for v in op.inputs)
        outs = ";".join(_type(graph.avals[v], axes.get(v)) for v in op.outputs)
        lines[layer].append(f"{op.name}({ins})->{outs}\n")
    return [hashlib.sha256("".join(sorted(ops)).encode()).hexdigest()[:16] for ops in lines]


def with_batch(args: tuple, batch_argnum: int, examples: int) -> tuple:
    """`args` as abstract values (`jax.ShapeDtypeStruct`), the batch's leading
    dimension set to `examples`: the layer programs run on zeros, so only shapes count."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, args)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((examples, *x.shape[1:]), x.dtype) if getattr(x, "shape", ()) else x,
                         abstract[batch_argnum])
    return (*abstract[:batch_argnum], batch, *abstract[batch_argnum + 1:])


@dataclass
class _Layer:
    """One distinct layer at one (dp, examples): its programs' runs, to time."""

    record: LayerRecord
    examples: int
    forward: Callable[[], Any]
    backward: Callable[[], Any] | None
    backward_remat: Callable[[], Any] | None
    once: list[Callable[[], Any]]
    forward_share: float  # of the fused last layer's program: the forward's FLOPs share
    peak_bytes: int
    merge: Callable[[], Any] | None = None  # the replica combine of the layer's gradients (`_merge_run`)
    count: int = 1  # the model's layers with this signature
    send: Callable[[], Any] | None = None  # the layer's input arriving from another stage's mesh (`_send_run`)
    fused: Callable[[], Any] | None = None  # the layer and the last one in one program, as a last stage runs them
    before: int = 0  # how many of the `count` layers come before the reference stage's end (`_layer_runs`)
    # The layer's gradient sums finished once a step: per-data-shard partial sums reduced over the data axis
    # (`Program.finish`), which a step runs inside its stage's update program; None where there are none.
    finish: Callable[[], Any] | None = None


@dataclass
class LayerTiming:
    """The runs a layer profile times and how their times become records: apart, so
    that a benchmark can time them in the same rounds as the steps it compares them
    with (on a shared host the machine's speed drifts by tens of percent within
    minutes, and a profile made before the steps prices them at another moment's)."""

    runs: list[Callable[[], Any]]  # each dispatches its program `back_to_back` times and returns the last result
    back_to_back: int
    launches: list[int]  # the data-parallel degrees whose launch runs come first in `runs`
    layers: list["_Layer"]
    together: list[tuple[int, int]] = field(default_factory=list)  # (dp, examples) of the whole-model runs after them
    platform: str = "cpu"  # of the devices timed: which clock times them (`timing.busy_clock`)
    # (dp, examples, programs dispatched, whether a split run follows) of the runtime's host-cost runs after
    # the whole-model runs: the interpreter alone, then the batch split (`hetpar.runtime.host_cost`)
    hosts: list[tuple[int, int, int, bool]] = field(default_factory=list)

    def measure(self, rounds: int = 7) -> list[LayerRecord]:
        """Times every run in one interleaved pool (`timing.median_times`, `rounds`
        rounds) and makes the records: a profile on its own, as `hetpar profile
        --layers` makes it."""
        from hetpar.predict.timing import busy_clock, median_times

        log.info("timing %d layer programs", len(self.runs))
        return self.records(median_times(self.runs, rounds=rounds, clock=busy_clock(self.platform)))

    def records(self, times: Sequence[float]) -> list[LayerRecord]:
        """The records of one time (seconds of `busy_clock()`, per run of `runs`) each."""
        if len(times) != len(self.runs):
            raise HetparError(f"{len(times)} times for {len(self.runs)} layer runs")
        it = iter(t / self.back_to_back for t in times)
        launch_s = {dp: next(it) for dp in self.launches}
        together = {key: next(it) for key in self.together}
        dispatch_s, split_s = {}, {}
        for dp, examples, dispatches, splits in self.hosts:
            dispatch_s[(dp, examples)] = next(it) / max(dispatches, 1)
            split_s[(dp, examples)] = next(it) if splits else 0.0
        apart: dict[tuple[int, int], list[float]] = {key: [0.0, 0.0] for key in self.together}  # seconds, programs
        last_s: dict[tuple[int, int], float] = {}  # the last layer's one program, per mesh and microbatch size
        records: dict[tuple, LayerRecord] = {}
        seen = []
        for layer in self.layers:
            forward = next(it)
            backward = next(it) if layer.backward is not None else None
            remat_s = next(it) if layer.backward_remat is not None else -1.0
            merge_s = next(it) if layer.merge is not None else 0.0
            send_s = next(it) if layer.send is not None else 0.0
            fused_s = next(it) if layer.fused is not None else 0.0
            # the finish's work, not its launch: a step runs it inside the stage's update program
            finish_s = max(0.0, next(it) - launch_s[layer.record.dp]) if layer.finish is not None else 0.0
            once = sum(next(it) for _ in layer.once) + finish_s
            key = (layer.record.dp, layer.examples)
            sums = apart.setdefault(key, [0.0, 0.0])
            if backward is not None:  # the reference stage's layers, each its own forward and backward program
                sums[0] += layer.before * (forward + backward)
                sums[1] += layer.before * 2
            else:
                last_s[key] = forward
            seen.append((layer, forward, backward, remat_s, merge_s, send_s, fused_s, once))
        # One more program's cost: the first layers one program each (a forward and a backward) against
        # all of them as one stage that is not the last (its forward and its backward program), per mesh
        # and microbatch size: it grows with the examples (on 4 CPU devices a plan of 1 example per device
        # was priced 21-27% under with the median over 1, 2 and 4 examples), so each point keeps its own
        # and the record the median of its mesh's. Not against the whole model as one program: that is
        # the last stage's, forward and backward fused, and what the fusion saves (on 4 CPU devices ~10%
        # of the model's time) was counted as per-program cost, which priced a stage of several layers
        # that is not the last 2 x (layers - 1) such costs too fast per microbatch.
        per_program: dict[tuple[int, int], float] = {}
        for key, t in together.items():
            seconds, programs = apart[key]
            if programs > 2:
                per_program[key] = (seconds - t) / (programs - 2)
        for layer, forward, backward, remat_s, merge_s, send_s, fused_s, once in seen:
            key = (layer.record.dp, layer.examples)
            program = max(launch_s[layer.record.dp], per_program.get(key, 0.0))
            if backward is None:  # the last layer: forward and backward are one program
                fused_s = forward
                forward, backward = forward * layer.forward_share, forward * (1 - layer.forward_share)
                remat_s = -1.0
            elif fused_s and key in last_s:  # the layer's share of its program with the last layer: that less the last's
                fused_s = max(0.0, fused_s - last_s[key] + program)
            else:
                fused_s = 0.0
            record = records.setdefault(layer.record.key, replace(layer.record, points=[]))
            record.program_s, record.once_programs = launch_s[record.dp], len(layer.once)
            record.merge_s = max(record.merge_s, merge_s)  # one per (dp, examples): the same arrays each time
            record.points.append(LayerPointRecord(layer.examples, forward, backward, remat_s, once, layer.peak_bytes, send_s,
                                                  fused_s=fused_s))
        for record in records.values():
            got = [v for (dp, _), v in per_program.items() if dp == record.dp]
            record.stage_program_s = max(record.program_s, statistics.median(got)) if got else 0.0
            record.points = [replace(p, stage_program_s=max(record.program_s, per_program[(record.dp, p.examples)]))
                             if (record.dp, p.examples) in per_program else p for p in record.points]
            mine = [v for (dp, _), v in dispatch_s.items() if dp == record.dp]
            record.dispatch_s = statistics.median(mine) if mine else 0.0
            record.points = [replace(p, split_s=split_s.get((record.dp, p.examples), 0.0)) for p in record.points]
        for record in records.values():
            record.points.sort(key=lambda p: p.examples)
        return list(records.values())


def layer_timing(
    fn: Callable,
    args: tuple,
    device_ids: Sequence[int],
    device_kind: str,
    examples: Sequence[int] = (1, 2, 4),
    data_parallel: Sequence[int] = (1,),
    num_layers: int | None = None,
    batch_argnum: int = 1,
    remat: bool = True,
    back_to_back: int = 4,
    host: Callable[[Any], Any] | None = None,
    tensor_parallel: Sequence[int] = (1,),
    shard: Callable[..., Any] | None = None,
) -> LayerTiming | Pooled:
    """Each distinct layer of `fn(*args)` on meshes of the first `dp` of `device_ids`
    for each `dp` in `data_parallel`, at `examples` per device and microbatch
    (`num_layers`: the cut; default the planner's, one layer per repeated block plus
    what comes before and after), as programs compiled and ready to time:
    `LayerTiming.measure` times them alone, a benchmark in its own rounds. Each run
    dispatches a program `back_to_back` times and waits once, as a pipeline's runtime
    dispatches a stage's programs one after another without waiting: a program timed
    alone and waited on also pays the devices going idle after it (on CPU, XLA's
    worker threads spinning before they sleep, which a later program queued behind it
    does not see). `host`: `hetpar.runtime.host_cost.host_runs`, passed in by the
    caller (this package does not import the runtime): with it, the runtime's own
    host work per program dispatch and its batch split are timed on each mesh's
    reference step (`LayerRecord.dispatch_s`, `LayerPointRecord.split_s`).
    `tensor_parallel`: the model axis's degrees, each crossed with `data_parallel`
    (meshes of more devices than there are left out), one `LayerTiming` each
    (`tp_profile.Pooled` for several); above 1 the layers are laid out by the sharding
    pass `shard` (`hetpar.shard.shard_stages`, passed in as `host` is: `tp_profile`)."""
    from hetpar.cluster.cluster import jax_devices

    if not examples or min(examples) < 1:
        raise HetparError(f"microbatch sizes to profile must be positive, got {list(examples)}")
    if not tensor_parallel or min(tensor_parallel) < 1:
        raise HetparError(f"tensor-parallel degrees to profile must be positive, got {list(tensor_parallel)}")
    if len(set(tensor_parallel)) > 1:
        return Pooled([layer_timing(fn, args, device_ids, device_kind, examples, data_parallel, num_layers, batch_argnum, remat,
                                    back_to_back, host, (tp,), shard) for tp in dict.fromkeys(tensor_parallel)])
    tp = tensor_parallel[0]
    if bad := [d for d in data_parallel if not 0 < d * tp <= len(device_ids)]:
        if len(bad) == len(data_parallel) or tp == 1:
            raise HetparError(f"cannot profile layers on {bad[0] * tp} devices ({bad[0]} data x {tp} tensor parallel): "
                              f"{len(device_ids)} {device_kind} devices here; pass degrees whose product is at most "
                              f"{len(device_ids)}")
        log.info("tensor-parallel degree %d: data-parallel degrees %s left out (more than %d devices)", tp, bad, len(device_ids))
        data_parallel = [d for d in data_parallel if d not in bad]
    if min(examples) * min(data_parallel) < 2:
        raise HetparError("a microbatch of one example traces apart from larger ones (hetpar runs none): profile at "
                          "least 2 examples per microbatch, e.g. --microbatch-sizes 2,4 on one device or 1,2 on two")
    platform = jax_devices(device_ids[:1])[0].platform
    shared = platform == "cpu"
    layers: list[_Layer] = []
    together: dict[tuple[int, int], Callable[[], Any]] = {}
    hosts: dict[tuple[int, int, int, bool], list[Callable[[], Any]]] = {}
    for dp in dict.fromkeys(data_parallel):
        for e in dict.fromkeys(examples):
            started = time.perf_counter()
            mine, whole, made = _layer_runs(fn, args, batch_argnum, device_ids[:dp * tp], device_kind, e, dp, num_layers, remat,
                                            shared, device_ids if e == min(examples) else None, device_ids, tp, shard, host)
            log.info("%s dp%d tp%d, %d examples: %d distinct layers ready in %.1f s", device_kind, dp, tp, e, len(mine),
                     time.perf_counter() - started)
            layers += mine
            if whole is not None:
                together[(dp, e)] = whole
            if made is not None and made.dispatches:
                hosts[(dp, e, made.dispatches, made.split is not None)] = [made.interpreter] + (
                    [made.split] if made.split is not None else [])
    launches = {dp: _launch_run(device_ids[:dp * tp]) for dp in dict.fromkeys(data_parallel)}
    runs: list[Callable[[], Any]] = [*launches.values(), *together.values(), *(r for rs in hosts.values() for r in rs)]
    k = max(1, back_to_back)
    runs = [_repeated(run, k) for run in runs]
    for layer in layers:
        runs += [_repeated(r, k) for r in (layer.forward, layer.backward, layer.backward_remat, layer.merge, layer.send,
                                           layer.fused, layer.finish, *layer.once) if r is not None]
    return LayerTiming(runs, k, list(launches), layers, list(together), platform, list(hosts))


def _layer_runs(fn: Callable, args: tuple, batch_argnum: int, device_ids: Sequence[int], device_kind: str, examples: int,
                dp: int, num_layers: int | None, remat: bool, shared: bool,
                merge_ids: Sequence[int] | None = None, send_ids: Sequence[int] | None = None, tp: int = 1,
                shard: Callable[..., Any] | None = None, host: Callable[[Any], Any] | None = None,
                ) -> tuple[list[_Layer], Callable[[], Any] | None, Any]:
    """The programs of each distinct layer, compiled alone on one mesh of `device_ids`
    (and with `merge_ids`, the devices there are, its replica combine: `_merge_run`;
    with `send_ids`, its input's arrival from another mesh of them: `_send_run`; the
    layer before the last: it and the last in one program, as a last stage runs them);
    and one microbatch of all the layers but the last two as one stage that is not the
    last, its forward and backward program (None for a model of fewer than 4 layers);
    and what `host` made of the reference compile those come from, a two-stage step on
    the one mesh (None for one layer, or without `host`), run before any run here holds
    an array (its state and activations beside them ran a 1.26B Llama out of an H100's
    memory). At `tp` > 1 the mesh is `dp` x `tp` and every compile applies the sharding
    pass's layouts (`tp_profile`)."""
    from hetpar.compile.programs import stage_mesh
    from hetpar.compile.step import compile_layer_stages
    from hetpar.predict.calibrate import program_inputs, program_run
    from hetpar.trace.flops import op_costs
    from hetpar.trace.layers import block_count, build_layers, compute_dtype
    from hetpar.trace.traced_step import trace_step

    # Two microbatches of `examples * dp`: the per-microbatch programs run at that size, accumulating
    # gradients as a pipeline's do (and a batch of one example would trace apart from larger ones).
    traced = trace_step(fn, with_batch(args, batch_argnum, 2 * examples * dp), batch_argnum, 2)
    flops = [c.flops for c in op_costs(traced.full)]
    layers = build_layers(traced.full, traced.analysis, flops, num_layers or block_count(traced.full, traced.analysis, flops))
    signatures = layer_signatures(traced.full, traced.analysis, layers)
    dtype = dtype_policy(compute_dtype(traced.full, flops))
    mesh = stage_mesh(tuple(device_ids), (dp, tp))
    stages = list(range(layers.num_layers))
    meshes = {i: mesh for i in stages}
    laid = layer_layouts(traced, layers, stages, device_ids, (dp, tp), device_kind, shard)
    plain = compile_layer_stages(traced, layers, stages, meshes, layouts=laid)
    rerun = compile_layer_stages(traced, layers, stages, meshes, remat="full", layouts=laid) if remat else None
    # One reference compile: the layers before the last two as one stage that is not the last (its
    # forward and backward program: the per-program cost's reference, `LayerTiming.records`), and
    # the last two layers as the last stage, forward and backward one program (what the layer before
    # the last costs inside a last stage's program, `LayerPointRecord.fused_s`).
    n = layers.num_layers
    whole = pair = made = None
    zeros: dict = {}  # every run's zero-filled arguments, one array per shape, dtype and sharding (`program_inputs`)
    if n > 1:
        split = [0] * (n - 2) + [1 if n > 2 else 0] * 2
        ref = compile_layer_stages(traced, layers, split, {s: mesh for s in set(split)},
                                   layouts=layer_layouts(traced, layers, split, device_ids, (dp, tp), device_kind, shard))
        if host is not None:
            started = time.perf_counter()
            made = host(ref)
            log.info("the runtime's host work on the reference step recorded in %.1f s", time.perf_counter() - started)
        last = [p for p in ref.programs if p.task.per_microbatch and p.task.stage == split[-1]]
        if len(last) == 1:
            pair = _carried_run(last[0], ref.graph, zeros)
        if n >= 4:  # at least two layers in the reference stage: its programs against theirs apart
            runs = [_carried_run(p, ref.graph, zeros) for p in ref.programs if p.task.per_microbatch and p.task.stage == 0]
            whole = lambda: [r() for r in runs]  # noqa: E731
    out, seen = [], set()
    for layer, signature in enumerate(signatures):
        if signature in seen:
            continue
        seen.add(signature)
        mine = [p for p in plain.programs if p.task.stage == layer]
        fwd = next(p for p in mine if p.task.kind == "fwd")
        bwd = next((p for p in mine if p.task.kind == "bwd"), None)
        redo = next((p for p in rerun.programs if p.task.stage == layer and p.task.kind == "bwd"), None) if rerun else None
        once = [p for p in mine if not p.task.per_microbatch]
        record = LayerRecord(signature, layers.names[layer], device_kind, dtype, tp, dp, shared)
        share = layers.forward_flops[layer] / layers.flops[layer] if layers.forward_flops and layers.flops[layer] else 1 / 3
        out.append(_Layer(
            record, examples, _carried_run(fwd, plain.graph, zeros), _carried_run(bwd, plain.graph, zeros) if bwd else None,
            _carried_run(redo, rerun.graph, zeros) if redo else None, [program_run(p, plain.graph, zeros) for p in once], share,
            max(_peak_bytes(p, plain.graph, lambda p, g: program_inputs(p, g, zeros)) for p in mine),
            _merge_run([(plain.graph.avals[v], None if v in p.stacked else sh.spec) for p in mine if p.task.per_microbatch
                        for v, sh in zip(p.task.reductions, p.acc_shardings)], device_ids, merge_ids, (dp, tp))
            if merge_ids is not None else None,
            signatures.count(signature),
            _send_run(fwd, plain, device_ids, send_ids, (dp, tp)) if send_ids is not None else None,
            pair if n > 1 and signature == signatures[n - 2] and bwd is not None else None,
            signatures[: n - 2].count(signature) if whole is not None else 0,
            _finish_run(next((p for p in mine if p.task.per_microbatch and p.finish is not None), None)),
        ))
    return out, whole, made


def _carried_run(program: Any, graph: Any, zeros: dict | None = None) -> Callable[[], Any]:
    """One microbatch of a per-microbatch `program` on zero-filled arguments, adding
    into the accumulators the previous run left (donated, as the pipeline's runtime
    passes them from microbatch to microbatch): a run that made fresh accumulators
    each time would also pay a zero-filling program's launch and writes, which a
    pipeline pays at most once per step, not per microbatch (on 4 CPU devices about
    5% of a transformer block's backward)."""
    from hetpar.predict.calibrate import program_inputs

    inputs = program_inputs(program, graph, zeros)
    acc = [program.init_acc() if program.init_acc else ()]

    def run() -> Any:
        out, acc[0] = program.fn(acc[0], *inputs)
        return out, acc[0]
    return run


def _finish_run(program: Any) -> Callable[[], Any] | None:
    """The once-a-step finish of `program`'s gradient sums (`Program.finish`: on a mesh
    of several devices, the per-shard partial sums reduced over the data axis), on
    accumulators of zeros; None for a program without one."""
    if program is None:
        return None
    acc = program.init_acc()
    return lambda: program.finish(acc)


def _merge_run(arrays: Sequence[tuple[Any, Any]], device_ids: Sequence[int], all_ids: Sequence[int],
               shape: tuple[int, ...] = ()) -> Callable[[], Any]:
    """What combining data-parallel replicas costs for one layer: another replica's
    gradients of the layer (`arrays`: aval and layout, None for whole, on the next
    `len(device_ids)` devices of `all_ids` where there are enough, else the same ones,
    shaped `shape`) each moved to this mesh and added to this replica's, one eager
    program per array, as the runtime's replica combine does (`hetpar.runtime.interpreter`).
    On a host with few cores and many arrays this costs far more than the bytes do:
    dispatch and placement per array."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from hetpar.compile.programs import stage_mesh

    n = len(device_ids)
    rest = [d for d in all_ids if d not in device_ids]
    here, there = stage_mesh(tuple(device_ids), shape), stage_mesh(tuple(rest[:n] if len(rest) >= n else device_ids), shape)
    home = [jax.device_put(jnp.zeros(a.shape, a.dtype), NamedSharding(here, spec or PartitionSpec())) for a, spec in arrays]
    other = [jax.device_put(jnp.zeros(a.shape, a.dtype), NamedSharding(there, spec or PartitionSpec())) for a, spec in arrays]
    return lambda: [jnp.add(h, jax.device_put(o, h.sharding)) for h, o in zip(home, other)]


def _send_run(program: Any, compiled: Any, device_ids: Sequence[int], all_ids: Sequence[int],
              shape: tuple[int, ...] = ()) -> Callable[[], Any] | None:
    """What a pipeline pays per microbatch to hand this layer its input from the stage
    before it: the forward program's inputs that another layer's forward makes (the
    activation; none for the first layer) moved from a mesh of the next
    `len(device_ids)` devices of `all_ids` (the same ones where there are too few)
    (shaped `shape`, as this one) to this program's sharding with `jax.device_put`, as the runtime's device path
    moves them (`hetpar.runtime.communicator`). The gradient going back is as many
    bytes the other way. On CPU devices this is a copy per shard and a dispatch, about
    a millisecond where the link's bytes are priced at hundredths of one. None where
    the layer has no such input."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from hetpar.compile.programs import stage_mesh

    made = {v for p in compiled.programs if p.task.kind == "fwd" and p.task.stage != program.task.stage for v in p.task.outputs}
    wanted = [(v, s) for v, s in zip(program.task.inputs, program.in_shardings) if v in made]
    if not wanted:
        return None
    n = len(device_ids)
    rest = [d for d in all_ids if d not in device_ids]
    there = stage_mesh(tuple(rest[:n] if len(rest) >= n else device_ids), shape)
    graph = compiled.graph
    sources = [jax.device_put(jnp.zeros(graph.avals[v].shape, graph.avals[v].dtype), NamedSharding(there, s.spec))
               for v, s in wanted]
    targets = [s for _, s in wanted]
    return lambda: [jax.device_put(x, t) for x, t in zip(sources, targets)]


def _repeated(run: Callable[[], Any], times: int) -> Callable[[], Any]:
    """`run` dispatched `times` times in a row; the last result (to wait on)."""
    def repeated() -> Any:
        out = None
        for _ in range(times):
            out = run()
        return out
    return repeated


def _launch_run(device_ids: Sequence[int]) -> Callable[[], Any]:
    """A program that does next to nothing on a mesh of `device_ids`: what launching
    any program there costs (dispatch, and on CPU the devices' threads waking)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from hetpar.compile.programs import stage_mesh

    mesh = stage_mesh(tuple(device_ids))
    split = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    x = jax.device_put(jnp.zeros((len(device_ids), 8), jnp.float32), split)
    fn = jax.jit(lambda x: x + 1, out_shardings=split)
    return lambda: fn(x)


def _peak_bytes(program: Any, graph: Any, inputs: Callable) -> int:
    """XLA's memory analysis of one program, per device (0 where the backend gives none)."""
    try:
        stats = program.fn.lower(program.init_acc() if program.init_acc else (), *inputs(program, graph)).compile().memory_analysis()
    except Exception as e:  # noqa: BLE001 - a backend without memory analysis: the record says 0
        log.info("no memory analysis for %s: %s", program.task.name, e)
        return 0
    if stats is None:
        return 0
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def merge_records(groups: Sequence[tuple[str, Sequence[LayerRecord]]]) -> list[LayerRecord]:
    """The layer records of several profiles (name, records) as one: one profile per
    device kind, so two that measured the same kind are refused (which to keep is
    the user's choice, not a silent last-one-wins)."""
    owner: dict[str, str] = {}
    out: list[LayerRecord] = []
    for name, records in groups:
        for kind in sorted({r.device_kind for r in records}):
            if kind in owner and owner[kind] != name:
                raise HetparError(f"both {owner[kind]} and {name} hold layer profiles of {kind}: merge one profile per "
                                  f"device kind (profile {kind} on one machine, or leave one of the two files out)")
            owner[kind] = name
        out += records
    return out


def problem_layers(records: Sequence[LayerRecord], signatures: Sequence[str], dtype: str,
                   kinds: Sequence[tuple[str, str]]) -> tuple[MeasuredLayer, ...]:
    """The records that fit the step being planned, as the estimator reads them: for
    every device kind of the problem (label, catalog name) and every layer whose
    signature and dtype a record of that device kind has, one `MeasuredLayer` per
    measured mesh degree."""
    by_key: dict[tuple[str, str], list[LayerRecord]] = {}
    for r in records:
        if r.dtype == dtype:
            by_key.setdefault((r.signature, r.device_kind), []).append(r)
    out = []
    for label, device_kind in kinds:
        for layer, signature in enumerate(signatures):
            for r in by_key.get((signature, device_kind), ()):
                points = tuple(LayerPoint(p.examples, p.forward_s, p.backward_s, p.backward_remat_s, p.once_s, p.send_s,
                                          p.stage_program_s, p.fused_s, p.split_s) for p in r.points)
                if points:
                    out.append(MeasuredLayer(label, layer, r.tp, r.dp, points, r.shared_host, r.program_s, r.once_programs,
                                            r.merge_s, r.stage_program_s, r.dispatch_s))
    return tuple(out)

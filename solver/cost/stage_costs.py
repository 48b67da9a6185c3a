"""The cost of one stage for every range of layers it could hold, as matrices.

A stage is `dp * tp` devices of one kind running layers [i, j) on microbatches of
`b` examples. Entry [i, j] of each matrix is that range's forward and backward time
per microbatch, its memory per device (`solver.memory`, the one memory model), and
its once-per-step tail (gradient all-reduce over the data-parallel devices, then the
optimizer), under the fastest ZeRO stage and recomputation choice that fits. Prefix sums make a
whole matrix a few numpy operations, which is what lets the search score thousands
of stage layouts in seconds.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from functools import lru_cache

import numpy as np

from solver.collectives import Topology, fastest_times
from solver.efficiency import matmul_rate
from solver.memory import (OFFLOAD_TIERS, DeviceMemory, StageActivations, in_flight, model_split_bytes, offloaded,
                           sharded_state, stage_memory)
from solver.cost.choice_memory import ChoiceMemory, held_activations, held_state, one_program
from solver.cost.choice_times import ChoiceTimes
from solver.cost.cut_sends import CutSends
from solver.cost.device_table import DeviceTables
from solver.cost.measured import LayerPrice, lookup
from solver.cost.model_axes import model_comm_s
from solver.cost.offload_prices import OffloadPrices
from solver.cost.problem import DeviceKind, Problem
from solver.cost.stage_config import StageConfig
from solver.cost.stage_tables import PerLayer, StageTable, StageVariant
from solver.cost.ranges import cumsum as _cumsum, first as _first, full as _full, last as _last
from solver.cost.ranges import range_max as _range_max, span as _span
from solver.cost.topologies import (across_nodes_s, across_topology, dp_sync_s, exposed, shares_sum_s, tp_allreduce_s,
                                    zero_topology)
from solver.zero import zero_time

INF = float("inf")


class StageCosts:
    """Cached stage tables for one problem."""

    def __init__(self, problem: Problem):
        self.problem = problem
        layers = problem.layers
        self.n = len(layers)
        self.flops = np.array([layer.flops for layer in layers])
        self.fwd_flops = np.array([layer.forward_flops for layer in layers])
        self.params = np.array([layer.param_bytes for layer in layers], dtype=float)
        self.unsplit = np.minimum(np.array([layer.unsplit_param_bytes for layer in layers], dtype=float), self.params)
        self.saved = np.array([layer.saved_bytes for layer in layers])
        self.inputs = np.array([layer.input_bytes for layer in layers])
        self.recomputed = np.array([layer.saved_bytes if layer.recomputed_bytes is None else layer.recomputed_bytes
                                    for layer in layers], dtype=float)
        self._recomputed_span = _span(_cumsum(self.recomputed))
        self.rerun_working_max = _range_max(np.array([2 * layer.largest_bytes if layer.rerun_working_bytes is None
                                                      else layer.rerun_working_bytes for layer in layers], dtype=float))
        self.tp_bytes = np.array([layer.tp_bytes for layer in layers])
        self.tp_count = np.array([layer.tp_collectives for layer in layers], dtype=float)
        self.matmuls = np.array([layer.matmuls for layer in layers], dtype=float)
        stated = np.array([layer.backward_matmuls for layer in layers], dtype=float)
        per_flop = self.matmuls / np.where(self.fwd_flops > 0, self.fwd_flops, 1.0)
        self.bwd_matmuls = np.where(stated > 0, stated, per_flop * (self.flops - self.fwd_flops))
        self.largest_max = _range_max(np.array([layer.largest_bytes for layer in layers], dtype=float))
        # Problem.layer_checkpoints: a range keeps every layer's input; its backward holds one layer's
        # activations, rerun, and that layer's backward working set at once
        self._inputs_span = _span(_cumsum(self.inputs))
        self._layer_rerun_max = _range_max(self.saved + 2 * np.array([layer.largest_bytes for layer in layers], dtype=float))
        self.recompute_flops = np.array([layer.recompute_flops for layer in layers], dtype=float)
        self.elementwise = np.array([layer.elementwise_bytes for layer in layers], dtype=float)
        self.bwd_elementwise = np.array([layer.backward_elementwise_bytes for layer in layers], dtype=float)
        self.elementwise_split = np.array([layer.elementwise_split for layer in layers], dtype=float)
        bwd_flops = self.flops - self.fwd_flops  # each pass's FLOPs and matmuls, what every stage's layer times read
        self._passes = tuple((flops, kernels > 0, np.maximum(kernels, 1.0))
                             for flops, kernels in ((self.fwd_flops, self.matmuls), (bwd_flops, self.bwd_matmuls)))
        self._bwd_work = bwd_flops + self.recompute_flops  # the backward's FLOPs with a rerun
        self._split_share = lru_cache(maxsize=None)(lambda tp: self.elementwise_split / tp + 1 - self.elementwise_split)
        self.kinds = {k.name: k for k in problem.kinds}
        self._tables = lru_cache(maxsize=None)(self._table)
        self._measured = lru_cache(maxsize=None)(self._measured_uncached)
        self._ranges = lru_cache(maxsize=None)(self._ranges_uncached)
        self._time_spans = lru_cache(maxsize=None)(self._time_spans_uncached)
        self._saved_span = lru_cache(maxsize=None)(lambda shard: _span(_cumsum(self.saved * shard)))  # `per_layer`'s saved
        self._layer_times_known: dict[tuple[StageConfig, float], tuple[np.ndarray, ...]] = {}  # `_layer_times`'
        self.per_layer = lru_cache(maxsize=None)(self._per_layer)  # the stage tables and the planner's bounds both read it
        # A stage's times do not depend on where it sits nor on what it holds, its memory's
        # parts not on how many microbatches it holds: each priced once, not once per table.
        self._times = lru_cache(maxsize=None)(self._times_uncached)
        self._fusion = lru_cache(maxsize=None)(self._fusion_uncached)
        self._placed_table_times = lru_cache(maxsize=None)(self._table_times_uncached)
        self._held_memory = lru_cache(maxsize=None)(self._held_memory_uncached)
        self._held_state = lru_cache(maxsize=None)(functools.partial(held_state, self))
        self._held_activations = lru_cache(maxsize=None)(functools.partial(held_activations, self))
        self._choice_times = ChoiceTimes(self)  # the times of every ZeRO stage of a stage at once
        # A last stage runs forward and backward as one program under every choice its table has (no
        # layer checkpoints to rerun): its memory, so its table, the same at every microbatch count.
        self._last_holds_one = all(one_program(self, True, remat) for remat in self.table_remats())
        self._choice_memory = ChoiceMemory(self)  # a table's memory for all its choices at once
        self._device_tables = DeviceTables(self)  # the tables of stages that keep their state on the devices
        self._params_max = lru_cache(maxsize=None)(lambda tp: _range_max(self.tp_params(tp)))
        self._grads = lru_cache(maxsize=None)(lambda tp: _span(_cumsum(self.tp_params(tp))))
        # ZeRO's collectives and the tail depend on the stage alone, not on its
        # microbatch or place: priced once per stage and ZeRO stage, not once per table.
        self.step_costs = lru_cache(maxsize=None)(self._step_costs)
        self._cut_sends = CutSends(self)  # stage pairs alike on the link share their sends
        self.offload = OffloadPrices(problem, self.kinds)  # where optimizer state may live off the devices, and its price
        self.nonempty = np.triu(np.ones((self.n + 1, self.n + 1), dtype=bool), k=1)  # [i, j] whose range holds a layer
        self._cells = np.arange((self.n + 1) ** 2).reshape(self.n + 1, self.n + 1)  # every pipeline through a cut asks again

    def tp_params(self, tp: int) -> np.ndarray:
        """Each layer's parameter bytes on one device of a `tp`-wide model axis: the
        matmuls' weights split, what no matmul reads (an embedding table) whole, as
        the sharding pass lays them out."""
        return model_split_bytes(self.params, self.unsplit, tp)

    def table(self, cfg: StageConfig, b: int, in_flight: int, last: bool = False, m: int = 1) -> StageTable:
        """Stage `cfg` on microbatches of `b` examples holding `in_flight` of them; `last`:
        the pipeline's last stage (forward and backward one program); `m`: microbatches
        per step, which weighs per-microbatch time against the once-per-step tail when
        choosing ZeRO and recomputation."""
        if last and self._last_holds_one:  # one program holds one microbatch, whatever the count: one table for all
            in_flight = 1
        return self._tables(cfg, b, in_flight, last, m)

    def capacity(self, kind: str) -> int:
        """Bytes a stage may use on each device: what the JAX client leaves a
        process's arrays (`DeviceKind.usable_bytes`) less the problem's reserve."""
        return int(self.kinds[kind].usable_bytes * (1 - self.problem.memory_reserve))

    def zero_stages(self, cfg: StageConfig) -> list[int]:
        """ZeRO stages worth trying: sharding over the data axis needs one (and a
        gradient to shard: a forward-only function keeps its parameters whole)."""
        if not self.problem.training:
            return [0]
        return [z for z in self.problem.zero_stages if z == 0 or cfg.dp > 1] or [0]

    def _state(self, params: np.ndarray, dp: int, zero: int) -> DeviceMemory:
        """Parameters, gradients and optimizer state per device (`params`: already
        split over the model axis) under ZeRO stage `zero`; parameters alone for a
        forward-only function."""
        if not self.problem.training:
            return sharded_state(params, 0.0 * params, 0.0 * params, dp, 0)
        return sharded_state(params, params, params * (self.problem.state_factor - 2), dp, zero)

    def times_key(self, cfg: StageConfig, b: int) -> tuple[StageConfig, float]:
        """What `per_layer`'s times depend on: modelled layers run alike on every stage of a
        kind and model axis giving each device as many examples (b / dp), so the search
        prices them once per such shape, as one device's slice of the data axis (a shared
        host's, measured and two model axes' read more: the stage itself)."""
        if self.kinds[cfg.kind].shared_host or cfg.model_collectives or self.problem.measured_layers:
            return cfg, b
        return StageConfig(cfg.kind, 1, cfg.tp), b / cfg.dp

    def _per_layer(self, cfg: StageConfig, b: int) -> PerLayer:
        """Each layer alone on one of these stages: the numbers every range sums, and
        what the planner's lower bounds take the least of (`state`: under the ZeRO
        stage that shards the most, so a bound never says too few layers fit)."""
        kind = self.kinds[cfg.kind]
        per_device = b / cfg.dp  # examples each data-parallel slice runs
        shard = per_device / cfg.tp  # activations split over tensor-parallel devices too (sequence parallel)
        params = self.tp_params(cfg.tp)
        state = self._state(params, cfg.dp, max(self.zero_stages(cfg)))
        held = state.state - (state.optimizer_state if self.offload.allowed(kind) else 0.0)  # the least on the device
        forward, backward, rerun, fused = self._layer_times(self.times_key(cfg, b))
        return PerLayer(
            forward=forward,
            backward=backward,
            state=held,
            saved=self.saved * shard,
            inputs=self.inputs * shard,
            recomputed=self.recomputed * shard,
            rerun=rerun,
            fused=fused,
        )

    def layer_times(self, cfg: StageConfig, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`per_layer`'s forward, backward, rerun and fused seconds alone (what the bounds' runs sum), cached per `times_key`."""
        return self._layer_times(self.times_key(cfg, b))

    def layer_times_of(self, keys: Iterable[tuple[StageConfig, float]]) -> list[tuple[np.ndarray, ...]]:
        """`layer_times` of each `times_key`, those not yet priced in one array pass per
        key's stage, a row per size: a planner's bounds ask for every layout of every
        kind at every microbatch size at once (on 64 GPUs of three kinds 138 keys, 14 ms
        priced one by one, each a few dozen numpy calls)."""
        keys = list(keys)
        self._price_layer_times([key for key in dict.fromkeys(keys) if key not in self._layer_times_known])
        return [self._layer_times_known[key] for key in keys]

    def _layer_times(self, key: tuple[StageConfig, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`layer_times` of a `times_key`, priced once."""
        if key not in self._layer_times_known:
            self._price_layer_times([key])
        return self._layer_times_known[key]

    def _price_layer_times(self, keys: list[tuple[StageConfig, float]]) -> None:
        """`_layer_times_rows` of these keys, one pass per stage."""
        by_stage: dict[StageConfig, list[float]] = {}
        for cfg, b in keys:
            by_stage.setdefault(cfg, []).append(b)
        for cfg, sizes in by_stage.items():
            self._layer_times_known.update(zip(((cfg, b) for b in sizes), self._layer_times_rows(cfg, sizes)))

    def _layer_times_rows(self, cfg: StageConfig, sizes: list[float]) -> list[tuple[np.ndarray, ...]]:
        """`per_layer`'s forward, backward, rerun and fused seconds for the times keys
        (cfg, b) of each b in `sizes`, a row of each array per size (every figure the
        same, bit for bit, as priced alone: the same operations element by element)."""
        per_device = np.array(sizes, dtype=float)[:, None] / cfg.dp  # examples each data-parallel slice runs
        kind = self.kinds[cfg.kind]
        speed = cfg.tp * self.matmul_rates(kind, cfg, per_device)
        bwd_speed = cfg.tp * self.matmul_rates(kind, cfg, per_device, backward=True)
        tp_comm = bwd_comm = tp_allreduce_s(kind, cfg.tp, self.tp_bytes * per_device, self.tp_count)  # backward as much
        if cfg.model_collectives:  # two model axes: what its layouts run, not Megatron's
            pairs = [model_comm_s(cfg.model_collectives, kind.intra, b, self.n) for b in sizes]
            tp_comm, bwd_comm = (np.array([pair[i] for pair in pairs]) for i in (0, 1))
        trains = float(self.problem.training)  # a forward-only function has no backward
        # memory-bound operators: their bytes, split like the activations where tensor parallelism splits them
        streaming = per_device * self._split_share(cfg.tp) / kind.memory_bandwidth  # (split / tp + 1 - split) bytes a byte
        forward = self.fwd_flops * per_device / speed + tp_comm + kind.layer_overhead_s / 3 + self.elementwise * streaming
        backward = trains * (self._bwd_work * per_device / bwd_speed + bwd_comm
                             + 2 * kind.layer_overhead_s / 3 + self.bwd_elementwise * streaming)
        if kind.shared_host:  # one host's cores run every device's share, one after another
            forward, backward = forward * cfg.devices, backward * cfg.devices
        rerun = np.array(forward, dtype=float)
        fused = np.array(forward + backward, dtype=float)
        for row, b in enumerate(sizes):
            for layer, price in self.measured(cfg, b / cfg.dp).items():  # measured beats modelled
                forward[row, layer], backward[row, layer] = price.forward_s, trains * price.backward_s
                rerun[row, layer] = price.forward_s if price.rerun_s is None else price.rerun_s
                fused[row, layer] = (price.fused_s if price.fused_s is not None and trains
                                     else forward[row, layer] + backward[row, layer])
        return list(zip(forward, backward, rerun, fused))

    def measured(self, cfg: StageConfig, per_device: float) -> dict[int, LayerPrice]:
        """The layers `Problem.measured_layers` prices on this stage config, at
        `per_device` examples per device and microbatch (solver.cost.measured); cached,
        as the search asks for the same stage many times."""
        if not self.problem.measured_layers:
            return {}
        return self._measured(cfg, float(per_device))

    def _measured_uncached(self, cfg: StageConfig, per_device: float) -> dict[int, LayerPrice]:
        out = {}
        for layer in range(self.n):
            price = lookup(self.problem.measured_layers, cfg.kind, layer, cfg.tp, cfg.dp, per_device)
            if price is not None:
                out[layer] = price
        return out

    def _optimizer(self, kind: DeviceKind, cfg: StageConfig) -> tuple[np.ndarray, np.ndarray]:
        """Per layer range: the update's seconds (the roofline's for modelled layers,
        each measured layer's own once-per-step time) and the gradient bytes the data
        axis still has to reduce (a layer measured on this data-parallel degree
        reduced its own in the measured time)."""
        prices = self.measured(cfg, 1.0)
        if not prices and not kind.shared_host:  # the roofline's alone, as every unprofiled plan is priced
            grads = self._grads(cfg.tp)
            return grads * self.problem.optimizer_traffic / kind.memory_bandwidth, grads
        params = self.tp_params(cfg.tp)
        once, unsynced, modelled = np.zeros(self.n), params.copy(), np.ones(self.n)
        for layer, price in prices.items():
            once[layer], modelled[layer] = price.once_s, 0.0
            if price.includes_sync:
                unsynced[layer] = 0.0
        per_device = params * modelled * self.problem.optimizer_traffic / kind.memory_bandwidth
        if kind.shared_host:
            per_device = per_device * cfg.devices
        prices = prices.values()
        launch, programs = max((p.once_launch_s for p in prices), default=0.0), max((p.once_programs for p in prices), default=0)
        return _span(_cumsum(per_device + once)) + programs * launch, _span(_cumsum(unsynced))

    def launches(self, cfg: StageConfig, per_device: float = 1.0) -> float:
        """What one more per-microbatch stage program costs on this stage's mesh, as
        its measured layers were timed with: taken out of each measured layer's times
        (`solver.cost.measured.lookup`) and paid once per stage program here. 0 where
        no layer of the stage config was measured. `per_device`: examples per device and
        microbatch (the cost grows with them where the profile measured it per size)."""
        return max((p.program_s for p in self.measured(cfg, per_device).values()), default=0.0)

    def dispatches(self, cfg: StageConfig) -> float:
        """What the runtime's own host work adds per stage program it dispatches, as
        the profile measured it (`MeasuredLayer.dispatch_s`): on a shared host (the
        devices are its cores) part of every step's time, paid per stage program
        beside `launches`. Elsewhere the host dispatches ahead of the devices while
        they compute, so 0; 0 too where nothing of the stage config was measured."""
        if not self.kinds[cfg.kind].shared_host:
            return 0.0
        return max((p.dispatch_s for p in self.measured(cfg, 1.0).values()), default=0.0)

    def split_s(self, cfg: StageConfig, b: int) -> float:
        """What cutting a pipeline's batch arguments into microbatches of `b` examples
        costs the runtime on this stage's mesh, once per step, as the profile measured
        it (`LayerPoint.split_s`); on a shared host only (elsewhere the host does it
        while the devices compute), 0 where not measured."""
        if not self.kinds[cfg.kind].shared_host:
            return 0.0
        return max((p.split_s for p in self.measured(cfg, b / cfg.dp).values()), default=0.0)

    def matmul_rates(self, kind: DeviceKind, cfg: StageConfig, per_device: float | np.ndarray,
                     backward: bool = False) -> np.ndarray:
        """FLOP/s of each layer's forward (or `backward`) pass on one device of this stage
        (a row per size where `per_device` is a column of them):
        the mean size of one matmul (the pass's FLOPs on this device over its matmul count)
        sets the rate. The mean is exact, not an approximation:
        on `solver.efficiency`'s curve a matmul of F FLOPs takes (F + F_half) / sustained
        seconds, so n matmuls take (their FLOPs + n F_half) / sustained whatever their sizes."""
        flops, counted, kernels = self._passes[backward]
        each = np.where(counted, flops * per_device / cfg.tp / kernels, 0.0)
        return np.asarray(matmul_rate(kind.flops, each, kind.matmul_half_flops), dtype=float).reshape(each.shape)

    def _table(self, cfg: StageConfig, b: int, held: int, last: bool, m: int) -> StageTable:
        """Every (ZeRO stage, recomputation) the problem allows, priced by `variant`;
        per range the fastest that fits."""
        if plan := self._device_tables.plan(cfg):  # on the devices only (most problems): the loop below's
            return self._device_tables.table(cfg, b, held, last, m, *plan)  # figures, without its lists
        capacity = self.capacity(cfg.kind)
        shape = (self.n + 1, self.n + 1)
        tiers = self.offload.tiers(cfg)
        host, disk = self.offload.host_capacity(cfg.kind), self.offload.nvme_capacity(cfg.kind)
        choices, fields, time_cost, _ = self._table_times(cfg, b, m, last)
        rows: list[tuple[int, str, str]] = []  # (ZeRO stage, recomputation, offload tier) per stacked row
        stacked: dict[str, list[np.ndarray]] = {name: [] for name in (*fields, "memory")}
        costs: list[np.ndarray] = []
        plain = totals = np.zeros(0)  # the on-device choices' costs and memory, all at once (`ChoiceMemory`)
        for offload in tiers:
            # Offloading only adds time: a tier is tried where some range fits in none tried
            # before it (host memory before disk), unless it is the only one allowed.
            if offload and (not host or offload == "nvme" and not disk
                            or costs and (np.min(costs, axis=0)[self.nonempty] < INF).all()):
                continue
            if not offload:  # every choice at once, by `variant`'s own sums (`ChoiceMemory`)
                totals = self._choice_memory.totals(cfg, b, held, last, choices)
                plain = np.where(totals <= capacity, time_cost, INF)
                stacked["memory"] += list(totals)
                for name in fields:
                    stacked[name] += list(fields[name])
                costs += list(plain)
                rows += [(zero, remat, "") for zero, remat in choices]
                continue
            for i, (zero, remat) in enumerate(choices):
                v = self.variant(cfg, b, held, last, zero, remat, offload=offload)
                total = v.memory.total
                fits = (total <= capacity) & (np.asarray(v.memory.host) <= host if offload else True)
                if offload == "nvme":
                    fits = fits & (np.asarray(v.memory.nvme) <= disk)
                tail = _full(v.tail, shape) if offload else fields["tail"][i]
                for name in fields:
                    stacked[name].append(tail if name == "tail" else fields[name][i])
                stacked["memory"].append(_full(total, shape))
                cost = time_cost[i] if not offload else m * (fields["forward"][i] + fields["backward"][i]) + tail
                costs.append(np.where(_full(fits, shape), cost, INF))
                rows.append((zero, remat, offload))
        only_plain = len(rows) == len(choices) and all(o == "" for _, _, o in rows)
        cost = plain if only_plain else np.stack(costs)
        pick = cost.argmin(axis=0)  # the first of the fastest, in the order above (ties keep the simpler choice)
        if only_plain:  # the times, already stacked in this order (`_table_times`), and the memory: not stacked again
            stacked.update(fields, memory=totals)
        cells = pick * pick.size + self._cells  # each range's entry in its picked row of a stack, flattened
        out = {name: (value if isinstance(value, np.ndarray) else np.stack(value)).reshape(-1)[cells]
               for name, value in stacked.items()}
        ok = np.triu(cost.reshape(-1)[cells] < INF, k=1)
        pick = pick[None]
        zero = np.array([z for z, _, _ in rows])[pick[0]]
        remat = np.array([bool(r) for _, r, _ in rows])[pick[0]]
        offload = np.array([OFFLOAD_TIERS.index(o) for _, _, o in rows])[pick[0]]
        return StageTable(np.where(ok, out["forward"], INF), np.where(ok, out["backward"], INF), remat & ok,
                          np.where(ok, out["memory"], 0.0), np.where(ok, out["tail"], 0.0), np.where(ok, out["sync"], 0.0),
                          capacity, np.where(ok, zero, 0), np.where(ok, offload, 0))

    def table_choices(self, cfg: StageConfig) -> list[tuple[int, str]]:
        """The (ZeRO stage, recomputation) choices a table picks from, in the order its ties keep."""
        return [(zero, remat) for zero in self.zero_stages(cfg) for remat in self.table_remats()]

    def table_remats(self) -> list[str]:
        """The recomputations a table picks among (large runs recompute always)."""
        return ["full"] if self.problem.force_remat else [""] + (["full"] if self.problem.allow_remat else [])

    def _table_times(self, cfg: StageConfig, b: int, m: int, last: bool = False) -> tuple[list, dict, np.ndarray, np.ndarray]:
        """Cached; a last stage's as any other's where its one program changes no time (`_fused_backward`)."""
        return self._placed_table_times(cfg, b, m, last and bool(self.measured(cfg, b / cfg.dp)))

    def _table_times_uncached(self, cfg: StageConfig, b: int, m: int,
                              last: bool = False) -> tuple[list[tuple[int, str]], dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """The (ZeRO stage, recomputation) choices a table picks from, their times stacked, what each
        costs a step of `m` microbatches (memory aside), and the times as one stack (its fields' base)."""
        choices = self.table_choices(cfg)
        times = [self._placed_times(cfg, b, zero, remat, last) for zero, remat in choices]
        stacked = np.empty((4, len(choices), self.n + 1, self.n + 1))
        for c, t in enumerate(times):
            stacked[:, c] = t[:4]  # each a layer-range array, or a view broadcast to one
        fields = dict(zip(("forward", "backward", "tail", "sync"), stacked))
        return choices, fields, m * (fields["forward"] + fields["backward"]) + fields["tail"], stacked

    def variant(self, cfg: StageConfig, b: int, held: int, last: bool, zero: int, remat: str,
                dots: float = 0.0, offload: str = "") -> StageVariant:
        """Stage `cfg` on microbatches of `b` examples holding `held` of them, under one
        ZeRO stage and recomputation policy, for every layer range: what the planner's
        tables choose among and what the estimator (`solver.cost.estimate`) reads for a
        plan whose choices are made. One function, so the two cannot disagree.
        `dots`: per example, the matmul results a "dots" policy keeps besides the
        stage's input (the planner never chooses it; a user may). `offload` "host": the
        optimizer state lives in host memory (`solver.memory.offloaded`) and the tail
        streams it in and out (`OffloadPrices.host_transfer_s`); "nvme": it lives on the
        node's disk, and the tail reads and writes it there too (`nvme_transfer_s`)."""
        state, activations, fused, workspace = self._held_memory(cfg, b, last, zero, remat, dots)
        memory = stage_memory(state, activations, held, remat, fused=fused, workspace=workspace)
        forward, backward, tail, sync, hidden = self._placed_times(cfg, b, zero, remat, last)
        if not offload:
            return StageVariant(forward, backward, memory, tail, sync, hidden)
        per_layer = self._params_max(cfg.tp) * max(self.problem.state_factor - 2, 0.0) / (cfg.zero_shards if zero >= 1 else 1)
        moved = self.offload.host_transfer_s(cfg, memory.optimizer_state)
        if offload == "nvme":
            moved = moved + self.offload.nvme_transfer_s(cfg, memory.optimizer_state)
        return StageVariant(forward, backward, offloaded(memory, offload, per_layer), tail + moved, sync, hidden)

    def _placed_times(self, cfg: StageConfig, b: int, zero: int, remat: str, last: bool) -> tuple[np.ndarray, ...]:
        """`_times` where the stage sits: on the last stage, its forward and backward
        one program (`_fused_backward`), unless it recomputes (priced as before)."""
        forward, backward, tail, sync, hidden = self._times(cfg, b, zero, remat)
        if last and not remat:
            backward = self._fused_backward(cfg, b, backward)
        return forward, backward, tail, sync, hidden

    def _fused_backward(self, cfg: StageConfig, b: int, backward: np.ndarray) -> np.ndarray:
        """The last stage's backward: its forward and backward are one program
        (hetpar.compile.tasks), so it pays one program's cost per microbatch, not two
        (`launches`, both in `forward` and `backward`), and its layers cost what they
        measured inside such a program (`PerLayer.fused`: XLA fuses across the two;
        the layers measured apart are priced as they were). The forward keeps its
        price, the backward is the rest. Unchanged where no layer was measured."""
        if not self.measured(cfg, b / cfg.dp):
            return backward
        return np.maximum(backward + self._fusion(cfg, b), 0.0)

    def _fusion_uncached(self, cfg: StageConfig, b: int) -> np.ndarray:
        """Per layer range, what a last stage's one program changes against two: one
        program's cost less, and each layer's fused time against its two apart."""
        layer = self.per_layer(cfg, b)
        return (_span(_cumsum(layer.fused - layer.forward - layer.backward)) - self.launches(cfg, b / cfg.dp)
                - self.dispatches(cfg))

    def _held_memory_uncached(self, cfg: StageConfig, b: int, last: bool, zero: int, remat: str,
                              dots: float) -> tuple[DeviceMemory, StageActivations, bool, np.ndarray | float]:
        """What `variant`'s memory is made of whatever the microbatches in flight: the
        state, one microbatch's activations, whether forward and backward are one
        program, the workspace (each part priced on what alone it depends on:
        `solver.cost.choice_memory`)."""
        state, workspace = self._held_state(cfg, zero)
        activations, fused = self._held_activations(cfg, b, last, remat, dots)
        return state, activations, fused, workspace

    def _times_uncached(self, cfg: StageConfig, b: int, zero: int, remat: str) -> tuple[np.ndarray, ...]:
        """`variant`'s times (forward, backward, tail, sync, hidden), the same wherever
        the stage sits and however many microbatches it holds."""
        if self.overlapped(cfg):
            f, bw, _, _, _ = self._ranges(cfg, b)
            v = self._overlapped(cfg, b, zero, remat, f, bw)
            return v.forward, v.backward, v.tail, v.sync, _full(v.hidden, f.shape)
        return self._choice_times.times(cfg, b, zero, remat)  # every ZeRO stage's at once, each floored at zero

    def overlapped(self, cfg: StageConfig) -> bool:
        """Whether the stage's data axis overlaps its collectives with compute (`_overlapped`)."""
        return self.problem.overlap_comm and self.problem.training and cfg.dp > 1

    def _buckets(self, cfg: StageConfig, zero: int = 0) -> dict[str, np.ndarray]:
        """Per layer (one gradient bucket each, as DDP and Megatron bucket them): the
        data axis's all-reduce, reduce-scatter and all-gather of that layer's bytes
        (under ZeRO on a hybrid stage, over its in-node shard group)."""
        kind, params = self.kinds[cfg.kind], self.tp_params(cfg.tp)
        topo = zero_topology(kind, cfg, zero)
        return {c: fastest_times(c, topo, params) for c in ("all_reduce", "reduce_scatter", "all_gather")}

    def _overlapped(self, cfg: StageConfig, b: int, zero: int, remat: str, f: np.ndarray, bw: np.ndarray) -> StageVariant:
        """`variant`'s times when the data axis's collectives overlap compute
        (`Problem.overlap_comm`): gradients are reduced bucket by bucket (a layer each)
        while the backward of earlier layers still runs, and ZeRO-3's all-gathers are
        prefetched a layer ahead; only the exposed part is priced (`exposed`).
        - ZeRO-0/1: one all-reduce per step, under the last microbatch's backward; ZeRO-1's
          all-gather of the updated shards follows the optimizer, exposed.
        - ZeRO-2: one reduce-scatter per step under the last backward (the accumulator is
          reduced once, as Megatron's distributed optimizer does), then the all-gather.
        - ZeRO-3: every microbatch's forward and backward all-gather its layers a layer
          ahead, and its backward reduce-scatters each layer's gradient as it is made.
        Tensor-parallel collectives stay on the critical path (in `per_layer`)."""
        layer = self.per_layer(cfg, b)
        kind, grads = self.kinds[cfg.kind], self._grads(cfg.tp)
        buckets = {c: _span(_cumsum(t)) for c, t in self._buckets(cfg, zero).items()}
        first = {c: _first(t) for c, t in self._buckets(cfg, zero).items()}  # the bucket of a range's first layer
        fwd_last, bwd_first = _last(layer.forward), _first(layer.backward)
        optimizer = self._optimizer(kind, cfg)[0]
        forward = f
        if zero >= 3:  # each layer's parameters gathered while the layer before it computes
            forward = f + exposed(buckets["all_gather"], first["all_gather"], f, fwd_last)
        backward_compute = bw + (forward if remat else 0.0)
        if zero >= 3:  # the backward gathers and reduce-scatters every layer, a layer ahead
            comm = buckets["all_gather"] + buckets["reduce_scatter"]
            backward = backward_compute + exposed(comm, first["all_gather"] + first["reduce_scatter"], backward_compute, bwd_first)
            reduce, hidden, post = 0.0 * grads, 0.0 * grads, 0.0 * grads
        else:
            backward = backward_compute
            name = "all_reduce" if zero <= 1 else "reduce_scatter"
            full = buckets[name]
            reduce = exposed(full, first[name], backward_compute, bwd_first)
            hidden = full - reduce
            post = fastest_times("all_gather", zero_topology(kind, cfg, zero), grads) if zero else 0.0 * grads
        if zero and cfg.hybrid:
            # A hybrid stage's shards all-reduced across nodes a layer at a time, once per
            # step, under the last microbatch's backward: what it does not hide is exposed.
            across = fastest_times("all_reduce", across_topology(kind, cfg), self.tp_params(cfg.tp) / cfg.zero_group)
            shown = exposed(_span(_cumsum(across)), _first(across), backward_compute, bwd_first)
            reduce, hidden = reduce + shown, hidden + _span(_cumsum(across)) - shown
        sync = reduce + post
        tail = sync + (optimizer / cfg.zero_shards if zero else optimizer)
        shape = f.shape
        return StageVariant(np.broadcast_to(forward, shape), np.broadcast_to(backward, shape), None,  # type: ignore[arg-type]
                            np.broadcast_to(tail, shape), np.broadcast_to(sync, shape), np.broadcast_to(hidden, shape))

    def _step_costs(self, cfg: StageConfig, zero: int) -> tuple[np.ndarray | float, np.ndarray | float, np.ndarray, np.ndarray]:
        """Per layer range of stage `cfg` under ZeRO stage `zero` (solver.zero, the one
        price of ZeRO): the collectives each microbatch's forward and backward add, the
        once-per-step gradient sync, and the tail (that sync plus the optimizer on each
        device's share: ZeRO-1+ updates a shard). The stage table and the planner's tail
        bound both read it. With `Problem.overlap_comm` the table prices the stage by
        `_overlapped` instead, and this is the least of that: what no compute hides."""
        kind, grads = self.kinds[cfg.kind], self._grads(cfg.tp)
        if not self.problem.training:
            return 0.0, 0.0, np.zeros_like(grads), np.zeros_like(grads)
        optimizer, unsynced = self._optimizer(kind, cfg)
        if self.problem.overlap_comm and cfg.dp > 1:
            # what `_overlapped` charges at the least, whatever the compute hiding the rest: the
            # updated shards' all-gather and the optimizer (the planner's bounds must stay below it)
            post = fastest_times("all_gather", zero_topology(kind, cfg, zero), grads) if zero in (1, 2) else 0.0 * grads
            return 0.0, 0.0, post, post + (optimizer / cfg.zero_shards if zero else optimizer)
        if zero:
            comm = zero_time(grads, grads, zero, zero_topology(kind, cfg, zero))
            step = comm.step + across_nodes_s(kind, cfg, grads)
            return comm.forward, comm.backward, step, step + optimizer / cfg.zero_shards
        sync = dp_sync_s(kind, cfg, unsynced)
        return 0.0, 0.0, sync, sync + optimizer

    def _ranges_uncached(self, cfg: StageConfig, b: int) -> tuple[np.ndarray, ...]:
        """What does not depend on the stage's place in the pipeline: times and
        activations of one microbatch, the gradient bytes (`per_layer`'s, summed per range
        once per `times_key` and per activations' shard, which stages share)."""
        forward, backward, rerun = self._time_spans(self.times_key(cfg, b))
        return forward, backward, self._saved_span(b / cfg.dp / cfg.tp), self._grads(cfg.tp), rerun

    def _time_spans_uncached(self, key: tuple[StageConfig, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`per_layer`'s forward, backward and rerun seconds (`_layer_times`) per layer range."""
        forward, backward, rerun, _ = self._layer_times(key)
        return _span(_cumsum(forward)), _span(_cumsum(backward)), _span(_cumsum(rerun))

    def replica_sync(self, kinds: list[str] | tuple[str, ...], streams: int) -> float:
        """Summing every gradient across pipelines of `kinds` (one per replica),
        `streams` devices wide each, as the runtime does (`topologies.shares_sum`:
        every replica adds all shares itself) over the slowest link between their
        kinds. What the planner bounds replica plans by and the estimator charges."""
        if not self.problem.training:
            return 0.0
        topology, share = self.replica_reduction(kinds, streams)
        return shares_sum_s(topology, len(kinds), share)

    def replica_reduction(self, kinds: list[str] | tuple[str, ...], streams: int) -> tuple[Topology, float]:
        """`replica_sync`'s sum: the replicas as a collective sees them, and the
        bytes of one replica's share in each of the `streams` side by side."""
        pairs = list(itertools.combinations(kinds, 2)) or [(kinds[0], kinds[0])]
        # Each stream is one device's share; a node's streams leave through its NICs together.
        per_node = min(self.kinds[k].devices_per_node for k in kinds)
        flows = max(1, min(streams, per_node))
        link = min((self.problem.link(a, b).per_flow(flows) for a, b in pairs), key=lambda c: c.bandwidth)
        return Topology(1, len(kinds), link, link), float(self.params.sum()) / max(streams, 1)

    def sends(self, a: StageConfig, c: StageConfig, b: int) -> np.ndarray:
        """Seconds to move one microbatch's activation across a cut before layer j,
        from stage `a` to the next stage `c`: each data-parallel slice sends its part.
        Cached and read-only: the search asks for the same cut thousands of times."""
        return self._cut_sends.sends(a, c, b)

    def least_sends(self, configs: list[StageConfig], b: int) -> np.ndarray:
        """[a, c]: the least of `sends(a, c, b)` over the cuts between layers, every
        ordered pair of `configs` (`CutSends.least_between`)."""
        return self._cut_sends.least_between(configs, b)


__all__ = ["INF", "StageConfig", "StageCosts", "StageTable", "StageVariant", "in_flight"]  # in_flight: solver.memory's, re-exported

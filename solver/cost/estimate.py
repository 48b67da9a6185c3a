"""The one price of a plan: given a model's costs and a cluster (a planner `Problem`)
and every choice a plan makes (`Decisions`), its per-stage times, memory by what
holds it, the fit of every device group, the simulated step, bubble and MFU.

Every plan goes through here, however it was made: the planner ranks its finalists
with it, hand-fixed configurations and hand-made plans are priced by it, and every
view (`hetpar solve`, `show`, `simulate`, `compare`, the Python API, the
benchmarks) prints its numbers. The stage figures come from the planner's own
`StageCosts.variant`, so a plan the planner chose is priced here exactly as the
search scored it, and any plan that makes the same choices gets the same figures.

Nothing here chooses: a stage's ZeRO stage and recomputation are decisions, and a
plan that does not fit is priced all the same and says where it overflows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from solver.memory import OFFLOAD_TIERS, DeviceMemory, in_flight
from solver.pipeline_sim import MAX_SIMULATED_MICROBATCHES, Simulation, pipeline_time, simulate, step_floor, step_time
from solver.cost.decisions import Decisions, StageDecision
from solver.cost.mixed import check_parts, mixed_position
from solver.cost.problem import PlanningError, Problem
from solver.cost.ranges import at as _at
from solver.cost.stage_costs import StageConfig, StageCosts
from solver.schedules import StageTimes

# Bumped whenever a change to the cost model changes a price: a plan file that keeps
# figures as a cache records the version they were made with.
ESTIMATOR_VERSION = 11  # 2: shared NICs, host-staged links, blocking sends, the JAX client's memory share;
# 3: measured layer profiles (solver.cost.measured), devices sharing one host run one after another;
# 4: a shared host's replica combine priced from the profile's measured merges (`cross_replica_sync_s`);
# 5: a shared host's sends priced from the profile's measured ones, both ways per microbatch (`serial_step_s`);
# a measured layer's net time (less the per-program cost) no longer floored at zero per layer, only the stage's;
# 6: a mixed stage updates on its lead and copies the parameters to its parts (`solver.cost.mixed.parameter_copy_s`)
# 7: measured layers: the per-program cost against a stage that is not the last (not the fused whole model),
# and the last stage priced as one program per microbatch at its layers' fused times (`StageCosts._fused_backward`)
# 8: every part of a mixed stage holds its optimizer state and updates its own copy (no parameter copy between kinds)
# 9: every replica sums all replicas' shares and updates its own copy (no parameter copy from replica 0): a shared
# host's combine is every replica's merges (`runtime_merges`), not replica 0's alone
# 10: a shared host pays the runtime's own host work, as the profile measured it (`hetpar.runtime.host_cost`): per
# stage program dispatched (`StageCosts.dispatches`) and each pipeline's batch split once per step (`StageCosts.split_s`)
# 11: the sum of 3+ replicas' or mixed-stage parts' shares is priced as the runtime makes it, every share to every
# other holder (`topologies.shares_sum`: the all-gather of all shares, not the ring all-reduce of one); two unchanged


@dataclass(frozen=True)
class StageCost:
    forward_s: float  # one microbatch
    backward_s: float
    send_s: float  # one microbatch's activation to the next stage
    sync_s: float  # gradient synchronisation once per step (across replicas included)
    optimizer_s: float
    memory: DeviceMemory  # per device, this stage alone
    capacity: int  # bytes a device may use (its memory less the problem's reserve)
    group_memory_bytes: float  # per device of the stage's device group: all its chunks together
    overlapped_s: float = 0.0  # the step's gradient reduction hidden under the last backward (not in sync_s)
    group_host_bytes: float = 0.0  # host memory per device of the device group (offloaded state), all chunks
    host_capacity: float = 0.0  # host memory a device may fill (its share of its node's); 0: unknown
    group_nvme_bytes: float = 0.0  # local-disk bytes per device of the device group (NVMe-tier state), all chunks
    nvme_capacity: float = 0.0  # disk bytes a device may fill (its share of its node's); 0: none declared

    @property
    def times(self) -> StageTimes:
        return StageTimes(self.forward_s, self.backward_s, self.send_s, self.sync_s, self.optimizer_s, self.overlapped_s)

    @property
    def fits_device(self) -> bool:
        return self.group_memory_bytes <= self.capacity

    @property
    def fits_host(self) -> bool:
        return self.group_host_bytes <= self.host_capacity if self.group_host_bytes else True

    @property
    def fits_nvme(self) -> bool:
        return self.group_nvme_bytes <= self.nvme_capacity if self.group_nvme_bytes else True

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host and self.fits_nvme


@dataclass(frozen=True)
class PlanCost:
    """A plan's price. `step_s` is the schedule simulated event by event (past
    `MAX_SIMULATED_MICROBATCHES` microbatches, its closed form), slowest replica."""

    stages: tuple[StageCost, ...]
    decisions: Decisions
    step_s: float
    closed_form_s: float
    cross_sync_s: float
    model_flops: float  # per step, without recomputation
    peak_flops: float  # of the devices the plan uses
    tokens_per_step: int

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_s / self.peak_flops if self.peak_flops and self.step_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s else 0.0

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def peak_memory_bytes(self) -> float:
        return max(s.group_memory_bytes for s in self.stages)

    def overflows(self) -> list[int]:
        """Positions of the stages whose device group does not fit."""
        return [i for i, s in enumerate(self.stages) if not s.fits]

    @cached_property
    def simulations(self) -> tuple[Simulation, ...]:
        """Each replica's pipeline simulated event by event (the timeline views draw)."""
        d = self.decisions
        if d.num_microbatches > MAX_SIMULATED_MICROBATCHES:
            raise ValueError(f"the plan has {d.num_microbatches} microbatches, more than the {MAX_SIMULATED_MICROBATCHES} "
                             f"simulated event by event; its closed-form step time is {self.closed_form_s:.6g} s")
        return tuple(simulate(self.replica_times(r), d.num_microbatches, d.schedule, d.chunks)
                     for r in range(len(d.replica_batch)))

    @property
    def bubble_fraction(self) -> float:
        """Share of the device groups' time idle inside the step: the simulation's, or
        (past the simulated size) the closed form's busy time against its step."""
        if self.decisions.num_microbatches <= MAX_SIMULATED_MICROBATCHES:
            busy = [b for sim in self.simulations for b in sim.busy_s]
        else:
            busy = self._closed_form_busy()
        return 1 - sum(busy) / (self.step_s * len(busy)) if busy and self.step_s else 0.0

    def replica_times(self, replica: int) -> list[StageTimes]:
        return [c.times for c, s in zip(self.stages, self.decisions.stages) if s.replica == replica and s.part_of < 0]

    def _closed_form_busy(self) -> list[float]:
        d = self.decisions
        busy = []
        for r in range(len(d.replica_batch)):
            times = self.replica_times(r)
            groups = len(times) // d.chunks
            for g in range(groups):
                mine = times[g::groups]
                busy.append(sum(d.num_microbatches * (t.forward_s + t.backward_s) + t.optimizer_s for t in mine))
        return busy


def estimate(problem: Problem, decisions: Decisions, costs: StageCosts | None = None, simulate_step: bool = True) -> PlanCost:
    """The price of `decisions` under `problem`'s cost model. `costs`: the problem's
    stage tables, when the caller has them (the planner) so they are built once.
    `simulate_step` False: the step is the schedule's closed form, not simulated (for
    a caller pricing many variants fast, e.g. a calibration's fit)."""
    costs = costs or StageCosts(problem)
    _check(problem, decisions)
    m, d = decisions.num_microbatches, decisions
    cross = cross_replica_sync_s(costs, d) if len(d.replica_batch) > 1 else 0.0
    priced: list[StageCost | None] = [None] * len(d.stages)
    index = {id(s): i for i, s in enumerate(d.stages)}
    for r, examples in enumerate(d.replica_batch):
        stages = d.replica_stages(r)
        b = examples // m
        configs = [s.config for s in stages]
        n, groups = len(stages), len(stages) // d.chunks
        raw = []
        for p, (s, cfg) in enumerate(zip(stages, configs)):
            held = in_flight(d.schedule, m, p, n, d.chunks)
            following = configs[p + 1] if p + 1 < n else None
            parts = d.parts(index[id(s)])
            if parts:  # a mixed-kind stage: each part priced at its rows, the slowest sets the pace
                mine = [_priced(costs, q, q.config, q.examples, held, p == n - 1, following) for q in parts]
                for q, r_ in zip(parts[1:], mine[1:]):
                    priced[index[id(q)]] = StageCost(*r_[1:6], r_[6], r_[7], r_[6].total, r_[8], r_[6].host,
                                                     costs.offload.host_capacity(q.kind), r_[6].nvme, costs.offload.nvme_capacity(q.kind))
                raw.append(mixed_position(costs, parts, mine))
            else:
                raw.append(_priced(costs, s, cfg, b, held, p == n - 1, following))
        group_total = [sum(raw[q][6].total for q in range(g, n, groups)) for g in range(groups)]
        group_host = [sum(raw[q][6].host for q in range(g, n, groups)) for g in range(groups)]
        group_nvme = [sum(raw[q][6].nvme for q in range(g, n, groups)) for g in range(groups)]
        raw = _blocking_sends(problem, raw)
        for p, (s, fwd, bwd, send, sync, opt, memory, capacity, hidden) in enumerate(raw):
            priced[index[id(s)]] = StageCost(fwd, bwd, send, sync + cross, opt, memory, capacity, group_total[p % groups], hidden,
                                             group_host[p % groups], costs.offload.host_capacity(s.kind),
                                             group_nvme[p % groups], costs.offload.nvme_capacity(s.kind))
    stage_costs = tuple(c for c in priced if c is not None)  # every stage: each replica's were priced
    per_replica = [[c.times for c, s in zip(stage_costs, d.stages) if s.replica == r and s.part_of < 0]
                   for r in range(len(d.replica_batch))]
    if _serial(problem, d):
        splits = sum(costs.split_s(d.replica_stages(r)[0].config, b // m) for r, b in enumerate(d.replica_batch))
        closed = serial_step_s(stage_costs, m, cross, splits)
    else:
        closed = max(pipeline_time(t, m, d.schedule, d.chunks) for t in per_replica)
    examples = sum(d.replica_batch)
    peak = sum(s.devices * (problem.kind(s.kind).peak_flops or problem.kind(s.kind).flops) for s in d.stages) / d.chunks
    cost = PlanCost(stage_costs, d, closed, closed, cross, float(costs.flops.sum()) * examples, peak,
                    examples * problem.tokens_per_example)
    return simulated(problem, cost) if simulate_step else cost


def _serial(problem: Problem, d: Decisions) -> bool:
    """Every stage on a shared host's cores: the step is their work one after another."""
    return all(problem.kind(s.kind).shared_host for s in d.stages)


def simulated(problem: Problem, cost: PlanCost) -> PlanCost:
    """`cost`, priced with `simulate_step` False, with the step `estimate` gives it: the
    slowest replica simulated (on a shared host the serial step it already has)."""
    d = cost.decisions
    if _serial(problem, d):
        return cost
    step = max(step_time(cost.replica_times(r), d.num_microbatches, d.schedule, d.chunks) for r in range(len(d.replica_batch)))
    return replace(cost, step_s=step)


def step_floor_s(problem: Problem, cost: PlanCost) -> float:
    """At most the step `simulated` gives `cost` (priced with `simulate_step` False), from
    its stage figures alone (`pipeline_sim.step_floor`): a ranking simulates only the
    plans whose floor could still win."""
    d = cost.decisions
    if _serial(problem, d) or d.num_microbatches > MAX_SIMULATED_MICROBATCHES:
        return cost.step_s  # the step itself: the serial sum, or the closed form past the simulated sizes
    return max(step_floor(cost.replica_times(r), d.num_microbatches, d.schedule, d.chunks) for r in range(len(d.replica_batch)))


def _priced(costs: StageCosts, s: StageDecision, cfg: StageConfig, b: int, held: int, last: bool,
            following: StageConfig | None) -> tuple:
    """Stage `s` on microbatches of `b` examples: (s, forward, backward, send, sync,
    optimizer, memory, capacity, hidden), as `estimate` assembles a replica's stages."""
    v = costs.variant(cfg, b, held, last, s.zero, s.remat, s.dots_bytes, s.offload)
    i, j = s.layer_start, s.layer_end
    shape = v.forward.shape
    at = lambda x: _at(x, shape, i, j)  # noqa: E731
    send = float(costs.sends(cfg, following, b)[j]) if following is not None else 0.0
    memory = DeviceMemory(at(v.memory.parameters), at(v.memory.gradients), at(v.memory.optimizer_state),
                          at(v.memory.activations), at(v.memory.workspace), at(v.memory.host), at(v.memory.nvme))
    return (s, at(v.forward), at(v.backward), send, at(v.sync), at(v.tail) - at(v.sync), memory,
            costs.capacity(s.kind), at(v.hidden))


def serial_step_s(stages: tuple[StageCost, ...], m: int, cross: float, splits: float = 0.0) -> float:
    """A step on devices that are one host's cores (`DeviceKind.shared_host`): no
    stage runs beside another, so the step is all of their work one after another,
    every microbatch's forward, backward and sends, each stage's once-per-step tail,
    and the cross-replica sum once (each stage's `sync_s` carries it). A stage that
    hands its activation on (`send_s` > 0) also gets its gradient back, as many bytes
    the other way (the simulator's transfers go both ways too): a training stage
    pays two sends per microbatch, a forward-only one (no backward) one. `splits`:
    the runtime cutting every pipeline's batch into microbatches (`StageCosts.split_s`),
    host work beside the stages', once per step."""
    work = sum(m * (c.forward_s + c.backward_s + (2 if c.backward_s > 0 else 1) * c.send_s) + c.sync_s - cross
               + c.optimizer_s + c.overlapped_s for c in stages)
    return work + cross + splits


def _blocking_sends(problem: Problem, raw: list[tuple]) -> list[tuple]:
    """Sends over a link whose transport blocks (`LinkCost.overlaps` False) hold
    their sender: stage p's forward waits for its activation to leave, stage p + 1's
    backward for the gradient to return, and nothing travels beside compute. The
    simulated schedule then sees them as compute, not as transfers."""
    out = [list(r) for r in raw]
    for p in range(len(raw) - 1):
        s, c, send = raw[p][0], raw[p + 1][0], raw[p][3]
        if send and not problem.link(s.kind, c.kind).overlaps:
            out[p][1] += send
            out[p + 1][2] += send
            out[p][3] = 0.0
    return [tuple(r) for r in out]


def cross_replica_sync_s(costs: StageCosts, decisions: Decisions) -> float:
    """Summing every gradient across the replicas: one stream per device of the
    smallest replica (`StageCosts.replica_sync`). On a shared host (CPU virtual
    devices) whose layers were measured, the runtime's combine as the profile timed
    it for those layers (`MeasuredLayer.merge_s`: one other replica's gradient
    arrays moved to a replica's mesh and added, one program each, which costs the
    host about a millisecond a layer where the collective's bytes are priced at a
    tenth of one) times the merges the runtime makes (`runtime_merges`: every
    replica makes the sum for its own update), and the collective's share of the
    other layers' bytes. Each replica's update itself is its own stages'
    `optimizer_s`, and its optimizer state their memory, as for any stage."""
    modelled = costs.replica_sync(*replica_streams(decisions))
    problem = costs.problem
    if not problem.measured_layers or not all(problem.kind(s.kind).shared_host for s in decisions.stages):
        return modelled
    merges, measured = 0.0, np.zeros(len(problem.layers), dtype=bool)
    for s in decisions.replica_stages(0):
        prices = costs.measured(s.config, 1.0)
        for layer in range(s.layer_start, s.layer_end):
            price = prices.get(layer)
            if price is not None and price.merge_s > 0:
                merges, measured[layer] = merges + price.merge_s, True
    total = float(costs.params.sum())
    rest = float(costs.params[~measured].sum()) / total if total > 0 else 0.0
    return merges * runtime_merges(len(decisions.replica_batch)) + modelled * rest


def runtime_merges(replicas: int) -> int:
    """The merges (and lone moves, priced as merges) the runtime makes to sum one
    reduction over `replicas` replicas so that every replica updates on the same sum
    (hetpar/runtime/replicas.py): each replica adds the R - 1 others' shares, and a
    replica past the second first moves replica 0's share to itself (one order for
    all, so every replica's sum is bit for bit replica 0's)."""
    return replicas * (replicas - 1) + max(replicas - 2, 0)


def replica_streams(decisions: Decisions) -> tuple[list[str], int]:
    """Each replica's (first stage's) device kind, and the streams the cross-replica
    sum runs side by side: one per device of the smallest replica."""
    kinds, sizes = [], []
    for r in range(len(decisions.replica_batch)):
        stages = decisions.replica_stages(r)
        kinds.append(stages[0].kind)
        sizes.append(sum(s.devices for s in stages[: len(stages) // decisions.chunks]))
    return kinds, min(sizes)


def _check(problem: Problem, d: Decisions) -> None:
    """Refuses decisions the cost model cannot price, naming the stage."""
    known = {k.name for k in problem.kinds}
    if d.num_microbatches < 1 or not d.replica_batch or not d.stages:
        raise PlanningError("a plan needs at least one stage, one microbatch and one replica")
    for i, s in enumerate(d.stages):
        if s.kind not in known:
            raise PlanningError(f"stage {i} runs on {s.kind!r}, which the cost model does not know; known: {', '.join(sorted(known))}")
        if not 0 <= s.replica < len(d.replica_batch):
            raise PlanningError(f"stage {i} belongs to replica {s.replica}; the plan has {len(d.replica_batch)} replica(s)")
        if s.offload not in OFFLOAD_TIERS:
            raise PlanningError(f"stage {i} offloads to {s.offload!r}; use one of {', '.join(repr(t) for t in OFFLOAD_TIERS)}")
        if s.offload and not problem.training:
            raise PlanningError(f"stage {i} offloads its optimizer state, but the function has no update (no optimizer state)")
        if s.zero_group < 0 or s.zero_group and s.dp % s.zero_group:
            raise PlanningError(f"stage {i}'s zero_group {s.zero_group} does not divide its data axis of {s.dp} devices; "
                                f"use a divisor of {s.dp} (the devices of a node) or 0 for all of them")
        if not 0 <= s.layer_start < s.layer_end <= len(problem.layers):
            raise PlanningError(f"stage {i} holds layers {s.layer_start}..{s.layer_end - 1}; the model has {len(problem.layers)}")
    check_parts(d)
    for r, examples in enumerate(d.replica_batch):
        if examples % d.num_microbatches:
            raise PlanningError(f"replica {r}'s {examples} examples do not split into {d.num_microbatches} microbatches")
        if len(d.replica_stages(r)) % d.chunks:
            raise PlanningError(f"replica {r}'s {len(d.replica_stages(r))} stages do not split into {d.chunks} chunks per device group")

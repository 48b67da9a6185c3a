"""Which collective algorithm each of a plan's collectives runs, as the estimator
prices them: what `hetpar show` lists and what a launch reads to switch the
collective library's algorithms on (`Algorithm.environment`).

The sizes and topologies are the estimator's own (`StageCosts`: its tensor-parallel
and data-parallel topologies, its per-layer bytes), and the choice is the registry's
(`solver.collectives.best`), so a view names the algorithm the price was made with.
Under `Problem.overlap_comm` gradients are reduced a layer at a time, so the message
named is the largest layer's; otherwise the stage's whole gradient, reduced once.
"""

from __future__ import annotations

from dataclasses import dataclass

from solver.collectives import Topology, best
from solver.cost.estimate import Decisions, StageDecision, replica_streams
from solver.cost.mixed import parts_reduction
from solver.cost.problem import Problem
from solver.cost.stage_costs import StageCosts
from solver.cost.topologies import across_topology, shares_sum, tp_topology, zero_topology


@dataclass(frozen=True)
class CollectiveUse:
    """One collective of a plan: the stage that runs it (its position in the plan's
    stages; None: across the replicas), what it moves, the collective, over how many
    devices, one call's bytes per device, the algorithm chosen for it and one call's
    seconds."""

    stage: int | None
    purpose: str
    collective: str
    devices: int
    nbytes: float
    algorithm: str
    seconds: float
    nodes: int = 1  # the nodes it spans: more than one, it crosses the network between them
    calls: int = 1  # how often it runs per step

    @property
    def bytes_per_step(self) -> float:
        """Each device's bytes of this collective per step (one call's times its calls)."""
        return self.nbytes * self.calls


def collectives_used(problem: Problem, decisions: Decisions, costs: StageCosts | None = None) -> tuple[CollectiveUse, ...]:
    """Every collective of the plan `decisions` makes, with its algorithm."""
    costs = costs or StageCosts(problem)
    out: list[CollectiveUse] = []
    m = decisions.num_microbatches
    for p, s in enumerate(decisions.stages):
        b = s.examples or decisions.replica_batch[s.replica] // m
        out += _stage_collectives(costs, p, s, b, m)
        if decisions.parts(p) and problem.training:  # a mixed stage: its parts' gradients summed
            topology, share = parts_reduction(costs, decisions.parts(p))
            collective, shares = shares_sum(len(decisions.parts(p)))
            out.append(_use(p, "gradients across a mixed stage's parts", collective, topology, shares * share))
    if len(decisions.replica_batch) > 1 and problem.training:
        kinds, streams = replica_streams(decisions)
        topology, share = costs.replica_reduction(kinds, streams)
        collective, shares = shares_sum(len(kinds))
        out.append(_use(None, "gradients across replicas", collective, topology, shares * share))
    return tuple(u for u in out if u.nbytes > 0)


def across_node_bytes(problem: Problem, decisions: Decisions) -> float:
    """Per device and step, the bytes of the plan's collectives that span several
    nodes (as priced): what a hybrid-sharded stage keeps down to one node-shard's
    gradient all-reduce."""
    return sum(u.bytes_per_step for u in collectives_used(problem, decisions) if u.nodes > 1)


def algorithms_used(problem: Problem, decisions: Decisions) -> frozenset[str]:
    """The names of the algorithms the plan's collectives run."""
    return frozenset(u.algorithm for u in collectives_used(problem, decisions))


def _stage_collectives(costs: StageCosts, p: int, s: StageDecision, b: int, m: int = 1) -> list[CollectiveUse]:
    kind, cfg = costs.kinds[s.kind], s.config
    i, j = s.layer_start, s.layer_end
    out = []
    if s.model_collectives:  # two model axes: the collectives its layouts run, each once per distinct message
        seen: dict[tuple, int] = {}
        for c in s.model_collectives:
            key = (c.collective, c.devices, c.message_bytes(b), c.backward)
            seen[key] = seen.get(key, 0) + c.count * m
        for (collective, devices, nbytes, backward), calls in seen.items():
            purpose = f"tensor-parallel {'backward' if backward else 'forward'} (as its 3-axis layouts run it)"
            out.append(_use(p, purpose, collective, tp_topology(kind, devices), nbytes, calls))
    elif s.tp > 1:
        per_device = b / s.dp
        each = (costs.tp_bytes[i:j] * per_device / costs.tp_count[i:j].clip(min=1.0)).max()
        out.append(_use(p, "tensor-parallel partial sums", "all_reduce", tp_topology(kind, s.tp), float(each)))
    if s.dp > 1 and costs.problem.training:
        topology = zero_topology(kind, cfg, s.zero)
        layers = costs.tp_params(s.tp)[i:j]
        grads = float(layers.max() if costs.problem.overlap_comm else layers.sum())
        per_step = int(layers.size) if costs.problem.overlap_comm else 1  # a bucket per layer, or the whole gradient once
        scattered = per_step * (1 if costs.problem.overlap_comm and s.zero == 2 else m)  # ZeRO-2/3: every microbatch's
        if s.zero <= 1:
            out.append(_use(p, "gradients", "all_reduce", topology, grads, per_step))
        else:
            out.append(_use(p, "gradients", "reduce_scatter", topology, grads, scattered))
        if s.zero in (1, 2):
            out.append(_use(p, "updated parameters", "all_gather", topology, float(layers.sum())))
        if s.zero == 3:
            out.append(_use(p, "parameters before use", "all_gather", topology, grads, 2 * scattered))
        if s.zero and cfg.hybrid:
            shard = float(layers.sum()) / cfg.zero_group
            out.append(_use(p, "gradient shards across replicas", "all_reduce", across_topology(kind, cfg), shard))
    return out


def _use(stage: int | None, purpose: str, collective: str, topology: Topology, nbytes: float, calls: int = 1) -> CollectiveUse:
    algorithm, seconds = best(collective, topology, nbytes)
    return CollectiveUse(stage, purpose, collective, topology.size, nbytes, algorithm, seconds, topology.nodes, calls)

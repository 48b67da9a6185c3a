"""Mixed-kind stages in the one estimator: a pipeline position whose data-parallel
parts sit on devices of different kinds (Metis's, HETHUB's and Whale's split), each
part taking `examples` rows of every microbatch.

Each part is priced as a stage of its own kind at its row count (its own
tensor- and data-parallel mesh, its own memory, its own ZeRO stage). The position runs
as fast as its slowest part: its forward, backward and send are the parts' largest.
Once per step the parts' gradients of the stage's layers are summed as the runtime
sums them (`hetpar/runtime/mixed.py`, `runtime/sums.py`: every part adds all parts'
shares itself, in one order), after each part's own data-parallel sum, over the
slowest link between their kinds (`StageCosts.replica_reduction`'s topology, a node's
flows sharing its NICs, `per_flow`), with the collective registry's fastest algorithm
for the collective that sum is (`topologies.shares_sum`). For two parts each sends its
whole share to the other, which is what the all-reduce of one share moves: together
with each part's own reduction that is the hierarchical all-reduce a same-kind stage
over two nodes pays (`topologies.dp_topology`: the in-node reduce-scatter and
all-gather, and between them each of a node's devices all-reducing its shard with its
counterparts over the node's NICs), and where the registry prices one all-reduce over
all the parts' devices faster (a flat ring, say), that is the price, as it would be
for a stage of one kind over the same nodes (`joined_topology`). For three or more
parts every part receives the k - 1 others' whole shares (the all-gather of all k),
k / 2 times what a ring all-reduce would move into it, and the joined all-reduce does
not stand in for it (the runtime runs no collective over all the parts' devices; for
two parts it stays the price, as a same-kind stage over the same nodes pays it).

Where the problem overlaps data-parallel collectives with compute
(`Problem.overlap_comm`), the sum between kinds is bucketed a layer at a time under
the last microbatch's backward as a stage's own reduction is (`topologies.exposed`),
on the compute the part's own buckets left free; without it both are exposed after the
last backward, as every stage's are.

The update is priced as the runtime runs it: every part ends the sum with the same
total and updates its own copy of the parameters with its own optimizer state, side
by side, so no parameters cross between kinds from one step to the next. A part's
memory holds the optimizer state as a stage's does (under its own ZeRO stage), and the
position's update is its slowest part's.
"""

from __future__ import annotations

import numpy as np

from solver.collectives import Topology, best
from solver.cost.decisions import Decisions, StageDecision
from solver.cost.problem import PlanningError
from solver.cost.stage_costs import StageCosts
from solver.cost.topologies import dp_topology, exposed, shares_sum_s, shares_sum_times


def parts_reduction(costs: StageCosts, parts: list[StageDecision]) -> tuple[Topology, float]:
    """The parts' gradient sum as a collective sees it: the parts' kinds over the
    slowest link between them, one stream per device of the smallest part, and the
    bytes of each part's share in each stream (the stage's layers' gradients over the
    streams)."""
    streams = min(q.devices for q in parts)
    topology, _ = costs.replica_reduction([q.kind for q in parts], streams)
    lead = parts[0]
    return topology, float(costs.params[lead.layer_start:lead.layer_end].sum()) / max(streams, 1)


def parts_sync_s(costs: StageCosts, parts: list[StageDecision]) -> float:
    """Seconds to sum the parts' gradients of their layers once per step as the
    runtime does (`topologies.shares_sum`), with the fastest algorithm the collective
    registry has for that collective, topology and size."""
    if not costs.problem.training:
        return 0.0
    topology, share = parts_reduction(costs, parts)
    return shares_sum_s(topology, len(parts), share)


def joined_topology(costs: StageCosts, parts: list[StageDecision]) -> Topology | None:
    """The parts' data axes as one same-kind stage's over their nodes would be
    (`topologies.dp_topology` per part): every part's nodes side by side, each node's
    devices over the slower kind's link inside a node, the nodes over the slowest of
    the kinds' own and the between-kinds links (a node's tp groups sharing them). So
    the registry may price the whole sum as it would a stage's over the same devices
    (a flat ring where that is faster than reducing in nodes first). None where the
    parts' meshes differ in tensor parallelism or devices per node (their devices hold
    different shards, or the nodes are not alike)."""
    tops = [dp_topology(costs.kinds[q.kind], q.config) for q in parts]
    if len({q.tp for q in parts}) > 1 or len({t.devices_per_node for t in tops}) > 1:
        return None
    groups = min(min(parts[0].tp, costs.kinds[q.kind].devices_per_node) for q in parts)
    between = [costs.problem.link(a.kind, b.kind).shared_by(groups) for k, a in enumerate(parts) for b in parts[k + 1:]
               if a.kind != b.kind]
    # the slowest as a node's devices see it together (a node of one NIC is slower than one
    # of four at the same per-flow rate)
    d = tops[0].devices_per_node
    slowest = lambda links: min(links, key=lambda c: c.per_flow(d).bandwidth)  # noqa: E731
    return Topology(sum(t.nodes for t in tops), tops[0].devices_per_node, slowest([t.intra for t in tops]),
                    slowest([t.inter for t in tops] + between))


def parts_sync_overlapped(costs: StageCosts, parts: list[StageDecision], priced: list[tuple]) -> tuple[float, float]:
    """(exposed, hidden) seconds of the parts' gradient sum. With `overlap_comm`, a
    bucket per layer (its bytes over the streams, each the registry's fastest
    `shares_sum` on the parts' topology) runs once the slowest part (the largest
    backward, whose layers come last) has made that layer's gradient, under the compute
    that part's own buckets left free; the first layer's bucket (made last) shows.
    Without it: all exposed, and for two parts, where one all-reduce over both parts'
    devices (`joined_topology`) beats each part's own sum followed by the sum between
    kinds, only what that one adds to the slowest part's own sum."""
    total = parts_sync_s(costs, parts)
    problem = costs.problem
    if not (problem.overlap_comm and problem.training) or total <= 0:
        own = max(r[4] for r in priced)
        alike = len(parts) == 2 and all(q.zero == 0 for q in parts) and total > 0
        joined = joined_topology(costs, parts) if alike else None
        if joined is not None:  # the whole sum as one all-reduce over the same devices, where that is faster
            lead = parts[0]
            whole = best("all_reduce", joined, float(costs.tp_params(lead.tp)[lead.layer_start:lead.layer_end].sum()))[1]
            return min(total, max(whole - own, 0.0)), 0.0
        return total, 0.0
    topology, _ = parts_reduction(costs, parts)
    streams = min(q.devices for q in parts)
    lead = parts[0]
    i, j = lead.layer_start, lead.layer_end
    buckets = shares_sum_times(topology, len(parts), costs.params[i:j] / max(streams, 1))
    k = max(range(len(parts)), key=lambda n: priced[n][2])  # the part whose backward ends last
    q = parts[k]
    compute = float(costs.per_layer(q.config, q.examples).backward[i:j].sum())
    free = max(compute - priced[k][8], 0.0)  # its own buckets already took this much of the stream
    first = float(costs.per_layer(q.config, q.examples).backward[i])
    shown = float(exposed(np.array(buckets.sum()), np.array(buckets[0]), np.array(free), np.array(min(first, free))))
    return shown, float(buckets.sum()) - shown


def mixed_position(costs: StageCosts, parts: list[StageDecision], priced: list[tuple]) -> tuple:
    """The pipeline position of a mixed stage, as `estimate` assembles a replica's
    stages (s, forward, backward, send, sync, optimizer, memory, capacity, hidden):
    the lead's memory, the slowest part's times, the parts' gradient sum added to the
    slowest part's own (its exposed part; the rest hidden), and the slowest part's
    update (every part updates its own copy, side by side)."""
    lead = priced[0]
    slowest = lambda k: max(r[k] for r in priced)  # noqa: E731
    shown, hidden = parts_sync_overlapped(costs, parts, priced)
    return (lead[0], slowest(1), slowest(2), slowest(3), slowest(4) + shown, slowest(5), lead[6], lead[7],
            slowest(8) + hidden)


def check_parts(d: Decisions) -> None:
    """Refuses mixed stages the cost model cannot price, naming the stage and the fix."""
    for i, s in enumerate(d.stages):
        if s.part_of < 0:
            continue
        if not 0 <= s.part_of < len(d.stages) or d.stages[s.part_of].part_of >= 0:
            raise PlanningError(f"stage {i} is a part of stage {s.part_of}, which is not a stage of its own; "
                                f"part_of names the mixed stage's first part")
        lead = d.stages[s.part_of]
        if (s.layer_start, s.layer_end, s.replica) != (lead.layer_start, lead.layer_end, lead.replica):
            raise PlanningError(f"stage {i} is a part of stage {s.part_of} but holds other layers or another replica")
        if d.chunks > 1:
            raise PlanningError("mixed-kind stages under an interleaved schedule are not supported; use one chunk per device group")
    for lead, _ in enumerate(d.stages):
        parts = d.parts(lead)
        if not parts:
            continue
        size = d.replica_batch[parts[0].replica] // d.num_microbatches
        counts = [q.examples for q in parts]
        if any(c < 1 for c in counts) or sum(counts) != size:
            raise PlanningError(f"the parts of mixed stage {lead} take {counts} examples of each microbatch of {size}: "
                                f"give each part at least one and make them sum to {size}")

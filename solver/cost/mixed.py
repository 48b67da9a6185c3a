"""Mixed-kind stages in the one estimator: a pipeline position whose data-parallel
parts sit on devices of different kinds (Metis's, HETHUB's and Whale's split), each
part taking `examples` rows of every microbatch.

Each part is priced as a stage of its own kind at its row count (its own
tensor- and data-parallel mesh, its own memory). The position runs as fast as its
slowest part: its forward, backward and send are the parts' largest. Once per step
the parts' gradients of the stage's layers are summed with the all-reduce the links
between their kinds favour (`StageCosts.replica_reduction`'s topology, the
collective registry's fastest algorithm), after each part's own data-parallel sum.
"""

from __future__ import annotations

from solver.collectives import Topology, best
from solver.cost.decisions import Decisions, StageDecision
from solver.cost.problem import PlanningError
from solver.cost.stage_costs import StageCosts


def parts_reduction(costs: StageCosts, parts: list[StageDecision]) -> tuple[Topology, float]:
    """The parts' gradient sum as a collective sees it: the parts' kinds over the
    slowest link between them, one stream per device of the smallest part, and the
    bytes of each stream (the stage's layers' gradients over the streams)."""
    streams = min(q.devices for q in parts)
    topology, _ = costs.replica_reduction([q.kind for q in parts], streams)
    lead = parts[0]
    return topology, float(costs.params[lead.layer_start:lead.layer_end].sum()) / max(streams, 1)


def parts_sync_s(costs: StageCosts, parts: list[StageDecision]) -> float:
    """Seconds to sum the parts' gradients of their layers once per step, with the
    fastest all-reduce the collective registry has for that topology and size."""
    if not costs.problem.training:
        return 0.0
    return best("all_reduce", *parts_reduction(costs, parts))[1]


def mixed_position(costs: StageCosts, parts: list[StageDecision], priced: list[tuple]) -> tuple:
    """The pipeline position of a mixed stage, as `estimate` assembles a replica's
    stages (s, forward, backward, send, sync, optimizer, memory, capacity, hidden):
    the lead's memory and update, the slowest part's times, and the parts' gradient
    sum added to the slowest part's own."""
    lead = priced[0]
    slowest = lambda k: max(r[k] for r in priced)  # noqa: E731
    sync = slowest(4) + parts_sync_s(costs, parts)
    return (lead[0], slowest(1), slowest(2), slowest(3), sync, lead[5], lead[6], lead[7], slowest(8))


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

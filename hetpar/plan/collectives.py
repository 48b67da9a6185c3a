"""A plan's collectives and the algorithm the estimator chose for each
(`solver.cost.collectives_used`), named by the plan's stages, for `hetpar show`; and
the collective library's settings those algorithms need (`Algorithm.environment`,
e.g. NCCL's CollNet switch for the in-network all-reduce), which `hetpar launch`
sets in its processes."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from hetpar.cluster.cluster import Cluster
from hetpar.plan.costs import decisions
from hetpar.plan.model import Plan
from solver import collectives
from solver.collectives import Topology
from solver.cost.collectives_used import CollectiveUse, collectives_used

# A message large enough that every algorithm a fabric offers is in the running.
_LARGE = float(2**30)


def plan_collectives(plan: Plan) -> tuple[CollectiveUse, ...]:
    """Each collective of `plan` with its algorithm, `stage` the plan's stage index
    (None: across replicas); nothing for a plan without cost inputs."""
    if plan.cost_inputs is None:
        return ()
    uses = collectives_used(plan.cost_inputs, decisions(plan))
    return tuple(u if u.stage is None else replace(u, stage=plan.stages[u.stage].index) for u in uses)


def library_environment(algorithms: Iterable[str]) -> dict[str, str]:
    """What the collective library needs set to run these registered algorithms."""
    env: dict[str, str] = {}
    for name in sorted(set(algorithms) - {"none"}):
        env.update(collectives.get(name).environment)
    return env


def plan_environment(plan: Plan) -> dict[str, str]:
    """The collective library's settings for the algorithms `plan` uses."""
    return library_environment(u.algorithm for u in plan_collectives(plan))


def cluster_environment(cluster: Cluster) -> dict[str, str]:
    """The settings for every algorithm the cluster's fabric can run (a group's
    devices across its nodes, or within a node), for a launch without a plan: the
    processes plan for themselves and may choose any of them."""
    names: set[str] = set()
    for g in cluster.groups:
        per_node = g.per_node
        shapes = [Topology(1, per_node, g.intra_cost(), g.intra_cost())] if per_node > 1 else []
        if g.nodes > 1:
            shapes.append(Topology(g.nodes, per_node, g.intra_cost(), g.inter_cost()))
        for topology in shapes:
            names |= set(collectives.costs("all_reduce", topology, _LARGE))
    return library_environment(names)

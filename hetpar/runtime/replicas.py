"""Data-parallel replicas in the runtime core: every replica sums all replicas' shares
of each reduction, then runs its own update.

Each replica (a whole pipeline on part of the batch) accumulates its share of every
reduction (gradients, loss sums). Every replica whose update reads a reduction then
makes the full sum on its own stage, adding the shares in one canonical order, replica
0's, 1's, 2's, ..., so every replica's sum, and so its update, is bit for bit replica
0's. Each replica receives the others' shares, as the estimator prices it
(`solver/cost/topologies.shares_sum`: one share's all-reduce for two, the all-gather of
all shares for more).
Each replica then updates its own copy of the parameters and optimizer state, which
the runtime keeps between calls (runtime/copies.StateCopies), so the next step moves
no parameters from replica 0 into the others. The step returns replica 0's results.

The order is kept without a move where the home holds a share it can start from
(runtime/sums.ordered_sum, as a mixed stage's parts sum theirs): replica 0's home
starts from its own share; replica 1's from its own with replica 0's merged in;
replica r >= 2's from replica 0's moved to it.
"""

from __future__ import annotations

from typing import Any

from hetpar.runtime.sums import MERGE_KIND, ordered_sum, update_targets


def update_homes(step: Any, targets: Any) -> dict[tuple[int, int], dict[int, Any]]:
    """(reduction, replica) -> stage -> where that stage's update wants it (its post
    program's input target), for every replica but 0 (whose sums stay where its
    backwards made them, as the step returns them). `targets`: the transport's, per
    program, per input."""
    return update_targets(step, targets, lambda task, replica: replica > 0)


def combine_replicas(step: Any, store: dict, transport: Any, homes: dict[tuple[int, int], dict[int, Any]]) -> None:
    """Every replica's sum of every reduction, in the store at (value, None, replica):
    replica 0's on every stage holding its share (a mixed stage's lead and its
    updating parts), each other replica's on the stages whose update reads it
    (`homes`, from `update_homes`); shares no update reads are dropped."""
    reductions = step.analysis.reductions
    values = dict.fromkeys(v for (v, mb, _) in store if mb is None and v in reductions)
    for value in values:
        held = {r: store[(value, None, r)] for r in range(step.num_replicas) if store.get((value, None, r))}
        if not held:
            continue
        how = MERGE_KIND[reductions[value]]
        shares = {r: next(iter(c.values())) for r, c in held.items()}  # each replica's own (its lead's) sum
        ranks = sorted(shares)

        def summed(replica: int, mine: Any, target: Any) -> Any:
            """The replicas' shares in rank order made where `mine` (this home's own share
            of `replica`, or None) lies, else at `target`."""
            ordered = [mine if r == replica and mine is not None else shares[r] for r in ranks]
            return ordered_sum(transport, how, ordered, ranks.index(replica) if mine is not None else None, target)

        for r in range(step.num_replicas):
            wanted = homes.get((value, r), {}) if r > 0 else {s: None for s in held.get(0, {})}
            sums = {stage: summed(r, held.get(r, {}).get(stage), target) for stage, target in wanted.items()}
            if sums:
                store[(value, None, r)] = sums
            else:
                store.pop((value, None, r), None)
        if 0 not in held:  # replica 0 made no share (its step output is the replicas' sum all the same)
            store[(value, None, 0)] = {stage: summed(ranks[0], x, None) for stage, x in held[ranks[0]].items()}

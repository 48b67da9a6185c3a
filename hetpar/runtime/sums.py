"""A reduction's shares summed in one order wherever an update reads it.

Several stages may update copies of the same state: a mixed-kind stage's parts
(runtime/mixed.py) and the data-parallel replicas (runtime/replicas.py). Each needs the
whole sum of every reduction (gradients, loss sums) its update reads, and all of them
must make the same numbers, so every copy is summed in one order: the first share,
then the second, and so on (a + b and b + a round alike, as do max and min, so a home
holding the second share may start from it). Every call is the transport's move or
merge, so every runtime (in one process, `jax.distributed`, Ray) sums alike.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

# How shares of a reduction combine (the reduction's kind -> the transport's merge).
MERGE_KIND = {"sum": "add", "mean": "add", "max": "maximum", "min": "minimum"}


def update_targets(step: Any, targets: Sequence[Sequence[Any]],
                   updating: Callable[[Any, int], bool]) -> dict[tuple[int, int], dict[int, Any]]:
    """(reduction, replica) -> stage -> where that stage's update wants the reduction
    (its post program's input target), for the post tasks `updating(task, replica)`
    picks. `targets`: the transport's, per program, per input."""
    reductions = step.analysis.reductions
    replica_of = step.replica_of or (0,) * len(step.tasks)
    homes: dict[tuple[int, int], dict[int, Any]] = {}
    for t, r, wanted in zip(step.tasks, replica_of, targets):
        if t.kind == "post" and updating(t, r):
            for v, target in zip(t.inputs, wanted):
                if v in reductions:
                    homes.setdefault((v, r), {}).setdefault(t.stage, target)
    return homes


def ordered_sum(transport: Any, how: str, shares: Sequence[Any], mine: int | None, target: Any) -> Any:
    """shares[0] + shares[1] + ..., made where shares[mine] lies (the home's own
    share), or at `target` where the home holds none (`mine` None): the first share
    moved there, then the others merged in."""
    if mine == 0:
        total, rest = shares[0], shares[1:]
    elif mine == 1:
        total, rest = transport.merge(how, shares[1], shares[0]), shares[2:]
    else:
        total, rest = transport.move(shares[0], target), shares[1:]
    for x in rest:
        total = transport.merge(how, total, x)
    return total

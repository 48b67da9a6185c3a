"""The state a runtime keeps between calls: every updating stage's own copy of the
new state it made, beside the array the step returned for it.

A step's updates run on several copies of the same state: a mixed-kind stage's parts
each update their own copy (runtime/mixed.py), and every data-parallel replica
updates its own on its own stages (runtime/replicas.py), all bit for bit replica 0's
lead's, whose arrays the step returns. When the caller passes a returned array back
in (the usual training loop), each of those stages reads its own copy where its
update left it, instead of receiving the returned array from replica 0's devices
every step: the copy that would otherwise be the all-reduce's second half again.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence


class StateCopies:
    """Per array the step returned (the same object, alive: a weak reference, so a
    dropped result frees its copies), the other updating stages' copies of it. A
    next call's argument that IS that array is read by each of those stages from
    its own copy, with no move; any other argument (changed, replaced, loaded) is
    copied from the argument, as on a first step. Holds values of the in-process and
    `jax.distributed` transports; Ray's step outputs come back to the driver as new
    arrays, so under Ray every stage copies its state from the arguments each step."""

    def __init__(self) -> None:
        # id(returned array) -> (a weak reference to it, stage -> that stage's copy)
        self._kept: dict[int, tuple[weakref.ref, dict[int, Any]]] = {}

    def carried(self, inputs: dict[int, Any]) -> dict[int, dict[int, Any]]:
        """Per step input (value index) that is an array the step returned last call:
        each other updating stage's own copy of it."""
        out = {}
        for value, x in inputs.items():
            entry = self._kept.get(id(x))
            if entry is not None and entry[0]() is x:
                out[value] = entry[1]
        return out

    def copy_of(self, x: Any, stage: int) -> Any:
        """Stage `stage`'s copy of `x`, an array the step returned last call (None if none)."""
        entry = self._kept.get(id(x))
        return entry[1].get(stage) if entry is not None and entry[0]() is x else None

    def keep(self, step: Any, outvars: Sequence[int], outputs: Sequence[Any], store: dict) -> None:
        """This call's copies of the values the other updates made (every post task but
        replica 0's leads': mixed stages' parts, replicas r > 0), replacing the last
        call's (which the stages have now read or never will). `store`: the
        interpreter's, (value, microbatch, replica) -> stage -> value."""
        made = {(v, t.stage) for t, r in zip(step.tasks, step.replica_of or (0,) * len(step.tasks))
                if t.kind == "post" and (r > 0 or (t.stage in step.rows and t.stage not in step.parts)) for v in t.outputs}
        replicas = step.num_replicas
        kept: dict[int, tuple[weakref.ref, dict[int, Any]]] = {}
        for v, x in zip(outvars, outputs):
            mine = {s: y for r in range(replicas) for s, y in (store.get((v, None, r)) or {}).items()
                    if (v, s) in made and y is not x}
            if mine:
                try:  # the copies go when the caller drops the returned array
                    kept[id(x)] = (weakref.ref(x, lambda _, key=id(x): kept.pop(key, None)), mine)
                except TypeError:  # not weakly referable: never taken for its copy
                    continue
        self._kept = kept

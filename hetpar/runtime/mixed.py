"""Mixed-kind stages in the runtime core: one pipeline position whose data-parallel
parts sit on meshes of different kinds, each running its rows of every microbatch
(`CompiledStep.rows`, from the plan's `StagePlan.examples`).

The parts' programs are the lead's forward and backward compiled at their own row
count (and its update, on the part's mesh), so everything the interpreter does for a
stage holds for a part, except that a part's per-microbatch values are its rows only. This keeps them apart from whole
values: a part reads its own rows of what it made itself, its cut of everything else
(a batch argument or whole-batch value cut straight at its rows; another stage's value
cut at its offset), and a stage that reads a value a mixed stage made gets the parts'
rows joined end to end along the batch axis. Each part accumulates its share of the
reductions over its rows; every part sums all parts' shares in one order on its own
mesh (`combine`, runtime/sums.ordered_sum), and runs its own copy of the stage's update
on its own copy of the parameters and optimizer state, so every part ends the step
with the lead's numbers and the next step needs no copy of the new parameters from the
lead (runtime/copies.StateCopies keeps the parts' copies between calls). The lead's
results are the step's; its pre work runs on the lead alone. Every transport call is one the interpreter already
makes (move, split, concatenate, merge, free), so every runtime runs mixed stages.
"""

from __future__ import annotations

from typing import Any

from hetpar.errors import PlanError
from hetpar.runtime.sums import ordered_sum, update_targets

class MixedStages:
    """The books of one step's mixed stages, beside the interpreter's value store."""

    def __init__(self, step: Any, transport: Any, store: dict, inputs: dict, merge_kind: dict[str, str]):
        """`merge_kind`: how shares of a reduction combine (its kind -> the transport's
        merge), the interpreter's, which parts' shares follow as replicas' do."""
        self.step, self.transport, self.store, self.inputs = step, transport, store, inputs
        self.merge_kind = merge_kind
        self.rows, self.parts = step.rows, step.parts
        self.lead = {s: lead for lead, mine in step.parts.items() for s in mine}
        # (reduction, replica) -> part stage -> where a non-lead part's update wants that
        # reduction (its post program's input target): where the part's sum is made.
        self.update_targets = update_targets(step, transport.targets,
                                             lambda task, _: task.stage in self.lead and task.stage not in self.parts)
        # (value, microbatch, replica) -> part stage -> the rows that part made
        self.pieces: dict[tuple[int, int, int], dict[int, Any]] = {}
        # (value, microbatch, replica, part stage) -> that part's rows of a value made elsewhere
        self.cuts: dict[tuple[int, int, int, int], Any] = {}
        # (value, replica) -> part stage -> that part's finished share of a reduction
        self.shares: dict[tuple[int, int], dict[int, Any]] = {}

    def _axis(self, value: int) -> int:
        axis = self.step.analysis.batch_axis.get(value)
        if axis is None:
            raise PlanError(f"value {value} crosses into or out of a mixed-kind stage but has no batch axis to split its "
                            f"rows along; run this step without mixed stages (each stage on one kind)")
        return axis

    def fetch(self, value: int, mb: int, replica: int, stage: int, target: Any) -> Any:
        """Part `stage`'s rows of per-microbatch value `value`, where `target` wants them."""
        mine = self.pieces.get((value, mb, replica))
        if mine is not None and stage in mine:
            return mine[stage]
        key = (value, mb, replica, stage)
        x = self.cuts.get(key)
        if x is not None:
            return x
        offset, count = self.rows[stage]
        analysis = self.step.analysis
        if value in analysis.sliced or ((value, mb, replica) not in self.store and mine is None and value in self.inputs):
            if value in analysis.sliced:  # drawn once for the whole batch
                whole = self.store.get((value, None, replica)) or self.store[(value, None, 0)]
                source, axis = next(iter(whole.values())), analysis.batch_axis[value]
            else:  # a batch argument
                source, axis = self.inputs[value], 0
            start = self.step.microbatch_slice(mb)[0] + offset
        else:
            copies = self.store.get((value, mb, replica)) or self.joined(value, mb, replica)
            if not copies:
                raise KeyError(f"value {value} of microbatch {mb} is read by mixed stage part {stage} before it is made")
            self.store[(value, mb, replica)] = copies
            source, axis, start = next(iter(copies.values())), self._axis(value), offset
        x = self.cuts[key] = self.transport.split(source, ((start, count),), axis, target)[0]
        return x

    def joined(self, value: int, mb: int, replica: int) -> dict[int, Any]:
        """The whole microbatch of a value a mixed stage's parts made, as a store entry
        (on the lead's mesh); {} when no mixed stage made it."""
        mine = self.pieces.get((value, mb, replica))
        if not mine:
            return {}
        lead = self.lead[next(iter(mine))]
        pieces = [mine[s] for s in self.parts[lead]]
        return {lead: self.transport.concatenate(pieces, self._axis(value))}

    def made(self, task: Any, mb: int, replica: int, outs: Any, finished: Any) -> None:
        """A part's program ran on its rows of microbatch `mb`: its outputs, and with
        `finished` (its last microbatch) its share of every reduction."""
        for v, x in zip(task.outputs, outs):
            self.pieces.setdefault((v, mb, replica), {})[task.stage] = x
        if finished is not None:
            for v, x in zip(task.reductions, finished):
                self.shares.setdefault((v, replica), {})[task.stage] = x

    def combine(self) -> None:
        """Each mixed stage's reductions summed (or maxed) over its parts, on every part
        whose update reads them: the same sum everywhere, so each part's update makes
        the lead's numbers. Each part adds the shares in one order, the parts' row
        order (`ordered_sum`: the first share moved to the part, then the others merged
        in), so no rounding differs between the parts;
        the lead's sum is the one the step returns and the replicas' combine reads."""
        kinds = self.step.analysis.reductions
        for (value, replica), shares in self.shares.items():
            lead = self.lead[next(iter(shares))]
            mine = [s for s in self.parts[lead] if s in shares]
            ordered = [shares[s] for s in mine]
            # the lead's sum always (the step returns it), a part's where its update reads it
            homes = {lead: None, **self.update_targets.get((value, replica), {})}
            self.store[(value, None, replica)] = {
                home: ordered_sum(self.transport, self.merge_kind[kinds[value]], ordered,
                                  mine.index(home) if home == lead else None, target)
                for home, target in homes.items() if home in mine}
        self.shares.clear()

    def release(self, mb: int, returned: set[int]) -> None:
        """Microbatch `mb`'s rows and cuts are dead (except the step's outputs)."""
        dead = [k for k in self.pieces if k[1] == mb and k[0] not in returned]
        cut = [k for k in self.cuts if k[1] == mb]
        if self.transport.frees:
            self.transport.free([x for k in dead for x in self.pieces[k].values()] + [self.cuts[k] for k in cut])
        for k in dead:
            del self.pieces[k]
        for k in cut:
            del self.cuts[k]

    def join_outputs(self, returned: set[int]) -> None:
        """Per-microbatch step outputs a mixed stage made, joined into whole microbatches
        in the store, where the interpreter assembles the step's outputs."""
        for (value, mb, replica) in list(self.pieces):
            if value in returned and (value, mb, replica) not in self.store:
                self.store[(value, mb, replica)] = self.joined(value, mb, replica)

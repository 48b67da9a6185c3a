"""Pipeline schedules as a dispatch order: the order in which a runtime dispatches
stage programs, fixed at compile time (it depends only on the tasks and the plan).

Dispatch is asynchronous, so the order is not the timing: each mesh runs its programs
as their inputs arrive. What the order fixes is which microbatches a stage holds at
once. The order is the schedule's own (`solver.schedules`): the simulator runs it
with equal stage times and the dispatch follows its events, so an interleaved
schedule's chunks on one mesh alternate as Megatron's do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from solver.pipeline_sim import simulate
from solver.schedules import DEFAULT, StageTimes


@dataclass(frozen=True)
class Step:
    program: int  # index into the compiled step's programs
    microbatch: int | None  # None for once-per-step work (pre, post)
    last_microbatch: bool = False  # the program's accumulators are final after this
    release: int | None = None  # per-microbatch values of this microbatch are dead after this
    combine: bool = False  # no program: reductions are final; every replica sums all replicas' shares
    fused: int | None = None  # the post program run inside this one (compiled.fused[program]); last microbatch only


def order(programs: Sequence, num_microbatches: int, schedule: str = DEFAULT, chunks: int = 1) -> list[Step]:
    """Pre work, the microbatches' forwards and backwards in the schedule's order,
    then post work. A stage whose forward program also runs its backward (the last)
    has no backward program. With `chunks` > 1 the stages are virtual: stage s runs
    on device group s mod (stages / chunks)."""

    def of(kind: str) -> dict[int, int]:
        return {p.task.stage: i for i, p in enumerate(programs) if p.task.kind == kind}

    fwd, bwd = of("fwd"), of("bwd")
    stages = sorted(set(fwd) | set(bwd))
    # The dependency order of a pipeline with equal stage times: any valid order would
    # do for correctness; this one is the schedule's own.
    times = [StageTimes(1.0, 1.0 if s in bwd else 0.0) for s in stages]
    events = simulate(times, num_microbatches, schedule, chunks).events
    m_last = num_microbatches - 1
    middle: list[Step] = []
    for e in sorted(events, key=lambda e: (e.start_s, e.device)):
        if e.kind not in ("forward", "backward"):
            continue
        stage = stages[e.stage]
        table = fwd if e.kind == "forward" else bwd
        if stage in table:
            middle.append(Step(table[stage], e.microbatch, e.microbatch == m_last))
    last_use = {s.microbatch: i for i, s in enumerate(middle)}
    middle = [Step(s.program, s.microbatch, s.last_microbatch, s.microbatch if last_use[s.microbatch] == i else None)
              for i, s in enumerate(middle)]
    once = lambda kind: [Step(i, None) for i, p in enumerate(programs) if p.task.kind == kind]  # noqa: E731
    return once("pre") + middle + [Step(-1, None, combine=True)] + once("post")


def replicated_order(programs: Sequence, replica_of: Sequence[int], num_microbatches: int, schedule: str,
                     chunks: int = 1) -> list[Step]:
    """Data-parallel pipelines side by side: each replica's pre work, then the
    replicas' microbatches interleaved (replica r's microbatch j is global microbatch
    r * num_microbatches + j), then one step that sums the replicas' reductions (on
    every replica), then every replica's post work, replica 0's first: its results
    are the step's; the others' keep each replica's own copy of the new state."""
    replicas = sorted(set(replica_of))
    per_replica = []
    for r in replicas:
        index = [i for i, rep in enumerate(replica_of) if rep == r]
        local = order([programs[i] for i in index], num_microbatches, schedule, chunks)
        per_replica.append([
            Step(index[s.program], None if s.microbatch is None else r * num_microbatches + s.microbatch,
                 s.last_microbatch, None if s.release is None else r * num_microbatches + s.release)
            for s in local if not s.combine
        ])
    kind = lambda s: programs[s.program].task.kind  # noqa: E731
    pre = [s for steps in per_replica for s in steps if kind(s) == "pre"]
    middle = [[s for s in steps if kind(s) in ("fwd", "bwd")] for steps in per_replica]
    interleaved = [s for group in _round_robin(middle) for s in group]
    post = [s for steps in per_replica for s in steps if kind(s) == "post"]
    return pre + interleaved + [Step(-1, None, combine=True)] + post


def _round_robin(lists: list[list[Step]]) -> list[list[Step]]:
    longest = max(len(steps) for steps in lists)
    return [[steps[i] for steps in lists if i < len(steps)] for i in range(longest)]


def fuse_updates(steps: Sequence[Step], fused_posts: dict[int, int]) -> list[Step]:
    """`steps` with each fused post program (`fused_posts`: host program -> post
    program) moved into its host's last-microbatch dispatch: one dispatch fewer per
    stage, and the update starts as soon as the stage's last backward does."""
    folded = set(fused_posts.values())
    return [
        replace(s, fused=fused_posts[s.program]) if s.last_microbatch and s.program in fused_posts else s
        for s in steps if not (s.microbatch is None and s.program in folded)
    ]


def with_parts(steps: Sequence[Step], own: Sequence[int], tasks: Sequence, parts: dict[int, tuple[int, ...]]) -> list[Step]:
    """`steps`, ordered over the programs `own` (positions in `tasks`: every task but
    mixed stages' non-lead parts), as steps over all of `tasks`: each dispatch of a
    mixed stage's lead's forward, backward or update followed by the same dispatch of
    its other parts' copies (the tasks after it of the same kind and phase whose stage
    is one of its parts: `parts`, lead -> its parts' stages), a microbatch's release
    moved to the last of them."""
    copies: dict[int, list[int]] = {}
    lead = None
    for i, t in enumerate(tasks):
        if lead is not None and t.kind == tasks[lead].kind and t.stage != tasks[lead].stage and t.stage in parts.get(tasks[lead].stage, ()):
            copies[lead].append(i)
            continue
        lead = i
        copies[i] = []
    out: list[Step] = []
    for s in steps:
        program = own[s.program] if s.program >= 0 else s.program
        extra = copies.get(program, [])
        if not extra:
            out.append(replace(s, program=program))
            continue
        out.append(replace(s, program=program, release=None))
        out += [replace(s, program=p, release=None) for p in extra[:-1]]
        out.append(replace(s, program=extra[-1]))
    return out

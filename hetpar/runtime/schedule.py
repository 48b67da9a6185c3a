"""Pipeline schedules: the order in which stage programs run in one step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Step:
    program: int  # index into the compiled step's programs
    microbatch: int | None  # None for once-per-step work (pre, post)
    last_microbatch: bool = False  # the program's accumulators are final after this
    release: int | None = None  # per-microbatch values of this microbatch are dead after this


def gpipe(programs: Sequence, num_microbatches: int) -> list[Step]:
    """GPipe: every forward of every microbatch, then every backward, stages in
    pipeline order (forward) and reverse order (backward)."""
    def of(kind: str) -> list[int]:
        return [i for i, p in enumerate(programs) if p.task.kind == kind]

    pre, fwd, bwd, post = of("pre"), of("fwd"), of("bwd"), of("post")
    fwd.sort(key=lambda i: programs[i].task.stage)
    bwd.sort(key=lambda i: -programs[i].task.stage)
    last = num_microbatches - 1
    order = [Step(i, None) for i in pre]
    order += [Step(i, m, m == last) for m in range(num_microbatches) for i in fwd]
    for m in range(num_microbatches):
        for j, i in enumerate(bwd):
            order.append(Step(i, m, m == last, release=m if j == len(bwd) - 1 else None))
    if not bwd:  # forward-only steps: release after the last forward
        order = [s if s.microbatch is None or s.program != fwd[-1] else Step(s.program, s.microbatch, s.last_microbatch, s.microbatch) for s in order]
    order += [Step(i, None) for i in post]
    return order

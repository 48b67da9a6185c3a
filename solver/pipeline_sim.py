"""Event-by-event simulation of one pipelined training step.

Each stage runs its forwards and backwards in the order its schedule gives; a
forward waits for the previous stage's forward of the same microbatch and the
activation's transfer, a backward for the next stage's backward and the gradient's
transfer back. Links between neighbouring stages carry one transfer at a time in
each direction. After its last backward a stage synchronises gradients across its
data-parallel replicas, then runs the optimizer. The step ends when every stage has.

This is the reference the closed-form estimate (`pipeline_time`) is checked against,
and what `hetpar simulate` draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

SCHEDULES = ("gpipe", "1f1b")
# Event by event costs time and memory linear in stages x microbatches; past this many
# microbatches callers that only need a time (or a picture) use the closed form (`pipeline_time`), which is exact for
# equal microbatches up to the links' queueing, instead of waiting minutes.
MAX_SIMULATED_MICROBATCHES = 4096


@dataclass(frozen=True)
class StageTimes:
    forward_s: float  # one microbatch
    backward_s: float  # one microbatch; 0 on a stage whose forward program also runs the backward
    send_s: float = 0.0  # one microbatch's activation to the next stage (its gradient comes back as fast)
    sync_s: float = 0.0  # gradient synchronisation across data-parallel replicas, once per step
    optimizer_s: float = 0.0  # once per step


@dataclass(frozen=True)
class Event:
    lane: str  # "stage 0", "link 0->1", ...
    name: str  # "F3", "B3", "send F3", "sync", "optimizer"
    kind: str  # "forward" | "backward" | "transfer" | "sync" | "optimizer"
    microbatch: int | None
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    events: tuple[Event, ...]
    step_s: float
    busy_s: tuple[float, ...]  # compute per stage

    @property
    def bubble_fraction(self) -> float:
        """Share of the stages' time spent idle inside the step."""
        total = self.step_s * len(self.busy_s)
        return 1 - sum(self.busy_s) / total if total else 0.0


def stage_order(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The (kind, microbatch) sequence a stage runs: GPipe does every forward, then
    every backward; 1F1B warms up with as many forwards as later stages, then
    alternates one forward and one backward, then drains the backwards."""
    m = num_microbatches
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    warmup = min(num_stages - stage - 1, m)
    order = [("F", j) for j in range(warmup)]
    for j in range(m - warmup):
        order += [("F", warmup + j), ("B", j)]
    order += [("B", j) for j in range(m - warmup, m)]
    return order


def simulate(stages: Sequence[StageTimes], num_microbatches: int, schedule: str = "gpipe") -> Simulation:
    n, m = len(stages), num_microbatches
    if n == 0 or m < 1:
        raise ValueError("a pipeline needs at least one stage and one microbatch")
    orders = [stage_order(schedule, s, n, m) for s in range(n)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> finish time
    arrived: dict[tuple[str, int, int], float] = {}  # activation/gradient available at a stage
    stage_free = [0.0] * n
    link_free = {(s, d): 0.0 for s in range(n) for d in (s - 1, s + 1) if 0 <= d < n}
    cursor = [0] * n
    events: list[Event] = []
    busy = [0.0] * n

    def ready(kind: str, s: int, j: int) -> float | None:
        if kind == "F":
            return 0.0 if s == 0 else arrived.get(("F", s, j))
        if ("F", s, j) not in done:
            return None
        return done[("F", s, j)] if s == n - 1 else arrived.get(("B", s, j))

    progressed = True
    while progressed:
        progressed = False
        for s in range(n):
            while cursor[s] < len(orders[s]):
                kind, j = orders[s][cursor[s]]
                at = ready(kind, s, j)
                if at is None:
                    break
                length = stages[s].forward_s if kind == "F" else stages[s].backward_s
                start = max(at, stage_free[s])
                end = start + length
                stage_free[s] = end
                busy[s] += length
                done[(kind, s, j)] = end
                events.append(Event(f"stage {s}", f"{kind}{j}", "forward" if kind == "F" else "backward", j, start, end))
                to = s + 1 if kind == "F" else s - 1
                if 0 <= to < n:
                    send = stages[min(s, to)].send_s
                    t0 = max(end, link_free[(s, to)])
                    link_free[(s, to)] = t0 + send
                    arrived[(kind, to, j)] = t0 + send
                    if send > 0:
                        events.append(Event(f"link {s}->{to}", f"send {kind}{j}", "transfer", j, t0, t0 + send))
                cursor[s] += 1
                progressed = True
    if any(c < len(o) for c, o in zip(cursor, orders)):
        raise RuntimeError("the schedule deadlocked: a stage waits on work that never runs")

    step = 0.0
    for s, times in enumerate(stages):
        t = stage_free[s]
        for kind, length in (("sync", times.sync_s), ("optimizer", times.optimizer_s)):
            if length > 0:
                events.append(Event(f"stage {s}", kind, kind, None, t, t + length))
                t += length
        step = max(step, t)
    events.sort(key=lambda e: (e.start_s, e.lane))
    return Simulation(tuple(events), step, tuple(busy))


def pipeline_time(stages: Sequence[StageTimes], num_microbatches: int, schedule: str = "gpipe") -> float:
    """Closed form of a step, for searches too large to simulate every candidate.

    A pipeline of identical microbatches is a flow shop: the first microbatch crosses
    every stage and link, the others follow at the pace of the slowest of them. GPipe
    runs two such passes, every forward and then every backward; 1F1B keeps one
    microbatch's forward and backward together in its steady state. Then the slowest
    stage's gradient sync and optimizer."""
    m = num_microbatches
    sends = [s.send_s for s in stages[:-1]]
    fwd = [s.forward_s for s in stages]
    bwd = [s.backward_s for s in stages]
    tail = max(s.sync_s + s.optimizer_s for s in stages)
    if schedule == "gpipe":
        forward = sum(fwd) + sum(sends) + (m - 1) * max(fwd + sends)
        backward = sum(bwd) + sum(sends) + (m - 1) * max(bwd + sends)
        return forward + backward + tail
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    per_mb = [f + b for f, b in zip(fwd, bwd)]
    return sum(per_mb) + 2 * sum(sends) + (m - 1) * max(per_mb + sends) + tail


def step_time(stages: Sequence[StageTimes], num_microbatches: int, schedule: str = "gpipe") -> float:
    """A step's time: simulated event by event up to MAX_SIMULATED_MICROBATCHES, the
    closed form past it (so any plan answers in milliseconds)."""
    if num_microbatches > MAX_SIMULATED_MICROBATCHES:
        return pipeline_time(stages, num_microbatches, schedule)
    return simulate(stages, num_microbatches, schedule).step_s

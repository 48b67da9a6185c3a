"""Event-by-event simulation of one pipelined training step, for any registered
schedule (`solver.schedules`).

Each device group runs its forwards and backwards in the order its schedule gives; a
forward waits for the previous (virtual) stage's forward of the same microbatch and
the activation's transfer, a backward for the next stage's backward and the gradient's
transfer back. Links between device groups carry one transfer at a time in each
direction; stages on the same group (chunks of an interleaved schedule) pass values
without a transfer. After its last backward a group synchronises its chunks'
gradients across data-parallel replicas, then runs the optimizer. The step ends when
every group has.

Events are structured (stage, chunk, device group, microbatch, kind); `lane` and
`name` are only their labels for people. This is the reference the closed forms
(`pipeline_time`) are checked against, what the dispatch order follows and what
`hetpar simulate` draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from solver.schedules import DEFAULT, StageTimes, get, names

# Event by event costs time and memory linear in stages x microbatches; past this many
# microbatches callers that only need a time (or a picture) use the closed form
# (`pipeline_time`) instead of waiting minutes.
MAX_SIMULATED_MICROBATCHES = 4096

__all__ = ["Event", "Simulation", "StageTimes", "names", "pipeline_time", "simulate"]


@dataclass(frozen=True)
class Event:
    kind: str  # "forward" | "backward" | "transfer" | "sync" | "optimizer" | "overlap" (communication under compute)
    microbatch: int | None
    start_s: float
    end_s: float
    device: int  # the device group that computes (a transfer's sender)
    stage: int | None = None  # the virtual stage computing (a transfer's sending stage); None for sync, optimizer
    chunk: int = 0  # which of the device group's chunks `stage` is
    to_device: int | None = None  # a transfer's receiving device group
    direction: str = ""  # a transfer's cargo: "F" (activation) or "B" (gradient)

    @property
    def lane(self) -> str:
        """A label for the row this event is drawn on."""
        if self.kind == "overlap":
            return f"comm {self.device}"
        return f"link {self.device}->{self.to_device}" if self.kind == "transfer" else f"stage {self.device}"

    @property
    def name(self) -> str:
        """"F3" (forward of microbatch 3), "B3.1" (backward, chunk 1), "send F3", "sync"."""
        if self.kind in ("sync", "optimizer"):
            return self.kind
        if self.kind == "overlap":
            return "sync (overlapped)"
        label = f"{'F' if self.kind == 'forward' else 'B' if self.kind == 'backward' else self.direction}{self.microbatch}"
        label += f".{self.chunk}" if self.chunk else ""
        return f"send {label}" if self.kind == "transfer" else label


@dataclass(frozen=True)
class Simulation:
    events: tuple[Event, ...]
    step_s: float
    busy_s: tuple[float, ...]  # compute per device group

    @property
    def bubble_fraction(self) -> float:
        """Share of the device groups' time spent idle inside the step."""
        total = self.step_s * len(self.busy_s)
        return 1 - sum(self.busy_s) / total if total else 0.0


def simulate(stages: Sequence[StageTimes], num_microbatches: int, schedule: str = DEFAULT, chunks: int = 1) -> Simulation:
    """`stages` are the virtual stages in pipeline order; with `chunks` = v, stage s
    runs on device group s mod (len(stages) / v)."""
    plan = get(schedule)
    n, m = len(stages), num_microbatches
    if n == 0 or m < 1 or chunks < 1 or n % chunks:
        raise ValueError(f"a pipeline needs at least one stage and one microbatch, and a whole number of stages per chunk "
                         f"(got {n} stages, {m} microbatches, {chunks} chunks)")
    d = n // chunks
    plan.validate(d, m, chunks)
    orders = [plan.device_order(g, d, m, chunks) for g in range(d)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> finish time
    arrived: dict[tuple[str, int, int], float] = {}  # activation/gradient available at a stage
    free = [0.0] * d
    link_free: dict[tuple[int, int], float] = {}
    cursor = [0] * d
    events: list[Event] = []
    busy = [0.0] * d

    def ready(kind: str, s: int, j: int) -> float | None:
        if kind == "F":
            return 0.0 if s == 0 else arrived.get(("F", s, j))
        if ("F", s, j) not in done:
            return None
        return done[("F", s, j)] if s == n - 1 else arrived.get(("B", s, j))

    progressed = True
    while progressed:
        progressed = False
        for g in range(d):
            while cursor[g] < len(orders[g]):
                work = orders[g][cursor[g]]
                s, j = work.stage(g, d), work.microbatch
                at = ready(work.kind, s, j)
                if at is None:
                    break
                length = stages[s].forward_s if work.kind == "F" else stages[s].backward_s
                start = max(at, free[g])
                end = free[g] = start + length
                busy[g] += length
                done[(work.kind, s, j)] = end
                events.append(Event("forward" if work.kind == "F" else "backward", j, start, end, g, s, work.chunk))
                to = s + 1 if work.kind == "F" else s - 1
                if 0 <= to < n:
                    arrived[(work.kind, to, j)] = _send(events, link_free, stages[min(s, to)].send_s, end, g, to % d, work, s)
                cursor[g] += 1
                progressed = True
    if any(c < len(o) for c, o in zip(cursor, orders)):
        raise RuntimeError(f"the {schedule} schedule deadlocked: a device group waits on work that never runs")

    step = 0.0
    for g in range(d):
        t = free[g]
        mine = [stages[s] for s in range(g, n, d)]
        hidden = sum(x.overlapped_s for x in mine)
        if hidden > 0:  # on its own track, ending as the last backward does (it ran under it)
            events.append(Event("overlap", None, t - hidden, t, g))
        for kind, length in (("sync", sum(x.sync_s for x in mine)), ("optimizer", sum(x.optimizer_s for x in mine))):
            if length > 0:
                events.append(Event(kind, None, t, t + length, g))
                t += length
        step = max(step, t)
    events.sort(key=lambda e: (e.start_s, e.device, e.kind == "transfer"))
    return Simulation(tuple(events), step, tuple(busy))


def _send(events: list[Event], link_free: dict[tuple[int, int], float], send_s: float, end: float, src: int, dst: int,
          work, stage: int) -> float:  # noqa: ANN001
    """When a value leaving `stage` (on group `src`) reaches group `dst`: at once on
    the same group, else after the link is free and the transfer done."""
    if src == dst:
        return end
    t0 = max(end, link_free.get((src, dst), 0.0))
    link_free[(src, dst)] = t0 + send_s
    if send_s > 0:
        events.append(Event("transfer", work.microbatch, t0, t0 + send_s, src, stage, work.chunk, dst, work.kind))
    return t0 + send_s


def pipeline_time(stages: Sequence[StageTimes], num_microbatches: int, schedule: str = DEFAULT, chunks: int = 1) -> float:
    """The schedule's closed-form step time (see each schedule's `step_time`)."""
    return get(schedule).step_time(stages, num_microbatches, chunks)


def step_time(stages: Sequence[StageTimes], num_microbatches: int, schedule: str = DEFAULT, chunks: int = 1) -> float:
    """A step's time: simulated event by event up to MAX_SIMULATED_MICROBATCHES, the
    closed form past it (so any plan answers in milliseconds)."""
    if num_microbatches > MAX_SIMULATED_MICROBATCHES:
        return pipeline_time(stages, num_microbatches, schedule, chunks)
    return simulate(stages, num_microbatches, schedule, chunks).step_s

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
from functools import lru_cache
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
    events: list[Event] = []
    step, busy = _run(stages, num_microbatches, schedule, chunks, events)
    events.sort(key=lambda e: (e.start_s, e.device, e.kind == "transfer"))
    return Simulation(tuple(events), step, busy)


def _run(stages: Sequence[StageTimes], num_microbatches: int, schedule: str, chunks: int,
         events: list[Event] | None) -> tuple[float, tuple[float, ...]]:
    """The simulation itself: the step and each group's busy time, and (where
    `events` is a list) every event appended to it. Without events it is what the
    planner's finalists are ranked by, thousands of times a search: the work runs
    in the order `_program` worked out for the shape, over plain lists."""
    n, m = len(stages), num_microbatches
    if n == 0 or m < 1 or chunks < 1 or n % chunks:
        raise ValueError(f"a pipeline needs at least one stage and one microbatch, and a whole number of stages per chunk "
                         f"(got {n} stages, {m} microbatches, {chunks} chunks)")
    d = n // chunks
    lengths = [s.forward_s for s in stages] + [s.backward_s for s in stages]  # work (forward?, s): [s] or [n + s]
    sends = [s.send_s for s in stages]
    ready = [0.0] * (2 * n * m)  # a forward's input (s * m + j), a backward's (n * m + s * m + j)
    free = [0.0] * d
    busy = [0.0] * d
    runs, links = _program(schedule, n, m, chunks)
    link_free = [0.0] * len(links)
    for g, steps in runs:
        t_free, t_busy = free[g], busy[g]  # this group's clock and busy time, kept local in its hot loop
        for read, work, write, link, send_s, label in steps:
            at = ready[read]
            length = lengths[work]
            start = at if at > t_free else t_free
            end = t_free = start + length
            t_busy += length
            if events is not None:
                events.append(Event("forward" if label[0] else "backward", label[2], start, end, g, label[1], label[3]))
            if link >= 0:  # the link between the groups carries one transfer at a time each way
                busy_until = link_free[link]
                t0 = end if end >= busy_until else busy_until
                arrival = ready[write] = link_free[link] = t0 + sends[send_s]
                if events is not None and sends[send_s] > 0:
                    events.append(Event("transfer", label[2], t0, arrival, g, label[1], label[3], links[link][1],
                                        "F" if label[0] else "B"))
            elif write >= 0:  # to a chunk on the same group, or the last stage's forward to its backward
                ready[write] = end
        free[g], busy[g] = t_free, t_busy
    return finish(stages, free, events), tuple(busy)


def finish(stages: Sequence[StageTimes], free: list[float], events: list[Event] | None) -> float:
    """The step's end: each device group, free after its last backward at `free[g]`,
    then syncs its chunks' gradients and runs their optimizer (the reduction overlapped
    with the backward drawn on its own track, ending with it)."""
    n, d = len(stages), len(free)
    step = 0.0
    for g in range(d):
        t = free[g]
        mine = [stages[s] for s in range(g, n, d)]
        hidden = sum(x.overlapped_s for x in mine)
        if hidden > 0 and events is not None:  # on its own track, ending as the last backward does (it ran under it)
            events.append(Event("overlap", None, t - hidden, t, g))
        for kind, length in (("sync", sum(x.sync_s for x in mine)), ("optimizer", sum(x.optimizer_s for x in mine))):
            if length > 0:
                if events is not None:
                    events.append(Event(kind, None, t, t + length, g))
                t += length
        step = max(step, t)
    return step


Step = tuple[int, int, int, int, int, tuple[bool, int, int, int]]


@lru_cache(maxsize=256)
def _program(schedule: str, n: int, m: int, chunks: int) -> tuple[tuple[tuple[int, Step], ...], tuple[tuple[int, int], ...]]:
    """The order `_run` runs a shape's work in, and what each piece reads and writes.
    Which work can run next depends only on which has run, never on the times, so the
    sweep over the groups (each runs its schedule's order until it waits on work not
    yet run, again while any ran) is the same for every pipeline of this shape and is
    worked out once. Returns the runs (group, its steps, in the order they run) and the
    links (sending group, receiving group). A step is (the `ready` slot it waits on,
    its `lengths` index, the slot it sets or -1, its link or -1, its send's stage,
    its label: forward?, virtual stage, microbatch, chunk). A backward waits on the
    next stage's gradient, the last stage's on its own forward (which sets that slot)."""
    d = n // chunks
    orders = _orders(schedule, d, m, chunks)
    done = [False] * (2 * n * m)
    for j in range(m):
        done[j] = True  # the first stage's inputs are there at the start
    links: dict[tuple[int, int], int] = {}
    cursor = [0] * d
    runs = []
    progressed = True
    while progressed:
        progressed = False
        for g in range(d):
            order, c, steps = orders[g], cursor[g], []
            while c < len(order):
                is_forward, s, j, chunk = order[c]
                read = (0 if is_forward else n * m) + s * m + j
                if not done[read]:
                    break
                to = s + 1 if is_forward else s - 1
                write, link, send_s = -1, -1, 0
                if is_forward and to == n:
                    write = n * m + s * m + j  # the last stage's backward waits on its forward
                elif 0 <= to < n:
                    write = (0 if is_forward else n * m) + to * m + j
                    if to % d != g:
                        link = links.setdefault((g, to % d), len(links))
                        send_s = s if s < to else to
                if write >= 0:
                    done[write] = True
                steps.append((read, s if is_forward else n + s, write, link, send_s, order[c]))
                c += 1
                progressed = True
            cursor[g] = c
            if steps:
                runs.append((g, tuple(steps)))
    if any(c < len(o) for c, o in zip(cursor, orders)):
        raise RuntimeError(f"the {schedule} schedule deadlocked: a device group waits on work that never runs")
    return tuple(runs), tuple(links)


@lru_cache(maxsize=256)
def _orders(schedule: str, d: int, m: int, chunks: int) -> tuple[tuple[tuple[bool, int, int, int], ...], ...]:
    """Each device group's work in its schedule's order, as (forward?, virtual stage,
    microbatch, chunk): the same for every pipeline of this shape."""
    plan = get(schedule)
    plan.validate(d, m, chunks)
    return tuple(tuple((w.kind == "F", w.stage(g, d), w.microbatch, w.chunk) for w in plan.device_order(g, d, m, chunks))
                 for g in range(d))


def step_floor(stages: Sequence[StageTimes], num_microbatches: int, schedule: str = DEFAULT, chunks: int = 1) -> float:
    """A lower bound on the simulated step (`step_time` within its simulated sizes) from
    the stages' figures alone, so a caller ranking many pipelines simulates only those
    that could win. Every device group runs its work one piece after another, then its
    tail: at least its busy time plus its tail. With one chunk, too, its first forward
    waits for the first microbatch's forwards and sends before it, and its last work
    (a backward: each forward's backward follows it on its group) has the backwards and
    sends before it still to run, then the first stage's tail. 0 where the schedule's
    orders miss some forward or backward (nothing then bounds the step)."""
    n, m = len(stages), num_microbatches
    if not _complete(schedule, n // chunks, m, chunks):
        return 0.0
    d = n // chunks
    busy, tail = [0.0] * d, [0.0] * d
    for s, t in enumerate(stages):
        busy[s % d] += m * (t.forward_s + t.backward_s)
        tail[s % d] += t.sync_s + t.optimizer_s
    if chunks > 1:
        return max(b + t for b, t in zip(busy, tail))
    floor = start = drain = 0.0  # drain: the backwards and sends from a stage back to the first
    for g, t in enumerate(stages):
        floor = max(floor, start + busy[g] + max(tail[g], drain + tail[0]))
        start += t.forward_s + t.send_s
        drain += t.send_s + t.backward_s
    return floor


@lru_cache(maxsize=256)
def _complete(schedule: str, d: int, m: int, chunks: int) -> bool:
    """Each device group's order runs every forward and backward of its chunks once."""
    want = {(f, c, j) for f in (True, False) for c in range(chunks) for j in range(m)}
    return all(len(order) == len(want) and {(f, s // d, j) for f, s, j, _ in order} == want
               for order in _orders(schedule, d, m, chunks))


def pipeline_time(stages: Sequence[StageTimes], num_microbatches: int, schedule: str = DEFAULT, chunks: int = 1) -> float:
    """The schedule's closed-form step time (see each schedule's `step_time`)."""
    return get(schedule).step_time(stages, num_microbatches, chunks)


def step_time(stages: Sequence[StageTimes], num_microbatches: int, schedule: str = DEFAULT, chunks: int = 1) -> float:
    """A step's time: simulated event by event up to MAX_SIMULATED_MICROBATCHES, the
    closed form past it (so any plan answers in milliseconds)."""
    if num_microbatches > MAX_SIMULATED_MICROBATCHES:
        return pipeline_time(stages, num_microbatches, schedule, chunks)
    return _run(stages, num_microbatches, schedule, chunks, None)[0]

"""`pipeline_sim._run` runs each shape's work in an order worked out once (`_program`):
its steps, busy times and events equal the sweep that asks what is ready each time."""

from __future__ import annotations

import random
from typing import Sequence

import pytest

from solver import pipeline_sim
from solver.pipeline_sim import Event, StageTimes


def _reference_run(stages: Sequence[StageTimes], num_microbatches: int, schedule: str, chunks: int,
         events: list[Event] | None) -> tuple[float, tuple[float, ...]]:
    """`pipeline_sim._run` as it was before `_program`: every sweep asks what is ready."""
    n, m = len(stages), num_microbatches
    if n == 0 or m < 1 or chunks < 1 or n % chunks:
        raise ValueError(f"a pipeline needs at least one stage and one microbatch, and a whole number of stages per chunk "
                         f"(got {n} stages, {m} microbatches, {chunks} chunks)")
    d = n // chunks
    orders = pipeline_sim._orders(schedule, d, m, chunks)
    forward = [s.forward_s for s in stages]
    backward = [s.backward_s for s in stages]
    sends = [s.send_s for s in stages]
    f_done: list[list[float | None]] = [[None] * m for _ in range(n)]  # finish of stage s's forward of microbatch j
    f_in: list[list[float | None]] = [[None] * m for _ in range(n)]  # its activation's arrival at stage s
    b_in: list[list[float | None]] = [[None] * m for _ in range(n)]  # the gradient's arrival at stage s
    for j in range(m):
        f_in[0][j] = 0.0
    free = [0.0] * d
    link_free: dict[tuple[int, int], float] = {}
    cursor = [0] * d
    busy = [0.0] * d
    lengths = [len(o) for o in orders]
    progressed = True
    while progressed:
        progressed = False
        for g in range(d):
            order, c, length_g = orders[g], cursor[g], lengths[g]
            t_free, t_busy = free[g], busy[g]  # this group's clock and busy time, kept local in its hot loop
            while c < length_g:
                is_forward, s, j, chunk = order[c]
                if is_forward:
                    at = f_in[s][j]
                    if at is None:
                        break
                    length = forward[s]
                else:
                    at = f_done[s][j]
                    if at is None:
                        break
                    if s != n - 1:
                        at = b_in[s][j]
                        if at is None:
                            break
                    length = backward[s]
                start = at if at > t_free else t_free
                end = t_free = start + length
                t_busy += length
                if is_forward:
                    f_done[s][j] = end
                if events is not None:
                    events.append(Event("forward" if is_forward else "backward", j, start, end, g, s, chunk))
                to = s + 1 if is_forward else s - 1
                if 0 <= to < n:
                    dst = to % d
                    if dst == g:
                        arrival = end
                    else:  # the link between the groups carries one transfer at a time each way
                        send_s = sends[s if s < to else to]
                        busy_until = link_free.get((g, dst), 0.0)
                        t0 = end if end >= busy_until else busy_until
                        arrival = link_free[(g, dst)] = t0 + send_s
                        if events is not None and send_s > 0:
                            events.append(Event("transfer", j, t0, arrival, g, s, chunk, dst, "F" if is_forward else "B"))
                    (f_in if is_forward else b_in)[to][j] = arrival
                c += 1
                progressed = True
            cursor[g], free[g], busy[g] = c, t_free, t_busy
    if any(c < len(o) for c, o in zip(cursor, orders)):
        raise RuntimeError(f"the {schedule} schedule deadlocked: a device group waits on work that never runs")

    return pipeline_sim.finish(stages, free, events), tuple(busy)



def _times(rng: random.Random, n: int) -> list[StageTimes]:
    return [StageTimes(rng.uniform(0.1, 2.0), rng.choice([0.0, rng.uniform(0.1, 3.0)]), rng.choice([0.0, rng.uniform(0.0, 0.5)]),
                       rng.uniform(0.0, 0.3), rng.uniform(0.0, 0.2), rng.choice([0.0, 0.1])) for _ in range(n)]


@pytest.mark.parametrize("schedule", pipeline_sim.names())
def test_the_program_runs_as_the_sweep_did(schedule):
    rng, checked = random.Random(7), 0
    for groups in (1, 2, 3, 4, 7):
        for chunks in (1, 2, 3):
            for m in (1, 2, 3, 4, 6, 8, 12, 13, 14):
                try:
                    pipeline_sim._orders(schedule, groups, m, chunks)
                except ValueError:
                    continue  # a shape the schedule refuses
                stages = _times(rng, groups * chunks)
                want_events: list[Event] = []
                got_events: list[Event] = []
                want = _reference_run(stages, m, schedule, chunks, want_events)
                assert pipeline_sim._run(stages, m, schedule, chunks, got_events) == want
                assert pipeline_sim._run(stages, m, schedule, chunks, None) == want
                assert got_events == want_events
                checked += 1
    assert checked >= 10

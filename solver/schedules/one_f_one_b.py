"""1F1B (PipeDream-flush, Narayanan et al. 2021): each stage warms up with as many
forwards as there are stages after it, then alternates one forward and one backward,
then drains its backwards. Same bubble as GPipe, but a stage keeps at most as many
microbatches as there are stages from it to the end."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from solver.schedules.base import Schedule, StageTimes, Work


def round_trip_pace(once, stages, num_microbatches: int):  # noqa: ANN001, ANN201 (a float or an array of them)
    """The least pace 1F1B's in-flight limit allows: its first stage keeps `stages`
    microbatches in flight, so it starts the next only when the one `stages` before it
    has come back, one round trip (`once`: a microbatch's forwards, backwards and the
    sends both ways) per `stages` microbatches. With no more microbatches than stages
    the limit is never reached (0). (`stages` may be an array: a count per entry of `once`.)"""
    if isinstance(stages, np.ndarray):
        return np.where(num_microbatches > stages, once / stages, 0 * once)
    return once / stages if num_microbatches > stages else 0 * once


class OneFOneB(Schedule):
    name = "1f1b"
    round_trip_limited = True

    def device_order(self, device: int, num_devices: int, num_microbatches: int, chunks: int = 1) -> list[Work]:
        m = num_microbatches
        warmup = min(num_devices - device - 1, m)
        order = [Work("F", 0, j) for j in range(warmup)]
        for j in range(m - warmup):
            order += [Work("F", 0, warmup + j), Work("B", 0, j)]
        return order + [Work("B", 0, j) for j in range(m - warmup, m)]

    def in_flight(self, num_microbatches: int, position: int, num_stages: int, chunks: int = 1) -> int:
        return min(num_microbatches, num_stages - position)

    def step_time(self, stages: Sequence[StageTimes], num_microbatches: int, chunks: int = 1) -> float:
        """One flow shop whose job is a microbatch's forward and backward together:
        the first crosses every stage and link both ways, the others follow at the pace
        of the slowest stage or link, or of the first stage's round trips where those
        are slower (`round_trip_pace`: large sends between busy stages); then the
        slowest tail."""
        m = num_microbatches
        sends = [s.send_s for s in stages[:-1]]
        per_mb = [s.forward_s + s.backward_s for s in stages]
        tail = max(s.sync_s + s.optimizer_s for s in stages)
        once = sum(per_mb) + 2 * sum(sends)
        return once + (m - 1) * max(max(per_mb + sends), round_trip_pace(once, len(stages), m)) + tail

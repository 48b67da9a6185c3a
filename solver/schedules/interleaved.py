"""Interleaved 1F1B (Megatron's virtual pipeline stages, Narayanan et al. SC'21).

Each of the D device groups holds v = `chunks` non-adjacent slices of the layers:
virtual stage s runs on group s mod D. A microbatch therefore crosses the D groups v
times, each crossing 1/v of the work, so the pipeline fills and drains v times faster:
the bubble shrinks from (D - 1) to (D - 1) / v stage-times, at the price of v times as
many sends. The order is Megatron's: microbatches go in groups of D, a group's forwards
run chunk after chunk (its backwards in reverse), each device warms up with
2 (D - d - 1) + (v - 1) D forwards, then alternates one forward and one backward.
Megatron's order needs the microbatch count to be a multiple of D.
"""

from __future__ import annotations

import math
from typing import Sequence

from solver.schedules.base import Schedule, StageTimes, Work, device_totals


class Interleaved1F1B(Schedule):
    name = "interleaved"
    interleaved = True
    default_chunks = 2

    def check(self, num_devices: int, num_microbatches: int, chunks: int) -> str | None:
        if chunks < 2:
            return f"the interleaved schedule needs at least 2 chunks per device group, got {chunks}; use '1f1b' for one"
        if num_devices < 2:
            return "the interleaved schedule needs at least 2 device groups; with one, chunks only add sends"
        if num_microbatches % num_devices:
            return (f"the interleaved schedule runs microbatches in groups of the {num_devices} device groups; "
                    f"{num_microbatches} microbatches is not a multiple: use {num_devices * max(1, num_microbatches // num_devices)}")
        return None

    def _warmup(self, device: int, num_devices: int, num_microbatches: int, chunks: int) -> int:
        return min((num_devices - device - 1) * 2 + (chunks - 1) * num_devices, num_microbatches * chunks)

    def device_order(self, device: int, num_devices: int, num_microbatches: int, chunks: int = 1) -> list[Work]:
        d, v = num_devices, chunks
        total = num_microbatches * v

        def work(kind: str, k: int) -> Work:
            chunk = (k % (d * v)) // d
            return Work(kind, chunk if kind == "F" else v - 1 - chunk, (k // (d * v)) * d + k % d)

        warmup = self._warmup(device, d, num_microbatches, v)
        order = [work("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [work("F", warmup + k), work("B", k)]
        return order + [work("B", k) for k in range(total - warmup, total)]

    def in_flight(self, num_microbatches: int, position: int, num_stages: int, chunks: int = 1) -> int:
        """A device keeps its warm-up forwards plus one, spread over its chunks."""
        d = num_stages // chunks
        held = self._warmup(position % d, d, num_microbatches, chunks) + 1
        return min(num_microbatches, math.ceil(held / chunks))

    def step_time(self, stages: Sequence[StageTimes], num_microbatches: int, chunks: int = 1) -> float:
        """1F1B's flow shop with v-times finer jobs: the first microbatch's compute
        across every stage counts 1/v (the fill and drain are v times shorter), but
        each of the v x more sends lies on that path in full (the price of
        interleaving); the other m - 1/v microbatches follow at the pace of the busiest
        device group (all its chunks) or link (all the sends it carries); then the
        busiest group's tails. With v = 1 this is 1F1B's form without its round trips
        (`one_f_one_b.round_trip_pace`)."""
        v, m = chunks, num_microbatches
        fwd, bwd, send, tail = device_totals(stages, v)
        per_mb = [s.forward_s + s.backward_s for s in stages]
        sends = [s.send_s for s in stages[:-1]]
        pace = max([f + b for f, b in zip(fwd, bwd)] + send)
        return sum(per_mb) / v + 2 * sum(sends) + (m - 1 / v) * pace + max(tail)

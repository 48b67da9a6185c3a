"""GPipe (Huang et al. 2019): every forward, then every backward. Simple, and every
stage keeps all microbatches' activations until its backwards run."""

from __future__ import annotations

from typing import Sequence

from solver.schedules.base import Schedule, StageTimes, Work


class GPipe(Schedule):
    name = "gpipe"
    # 1F1B runs the same flow shop with each microbatch's forward and backward kept
    # together: it is never larger, and slower only where it waits for its round trips
    # (sends as slow as the stages), which GPipe avoids by holding every microbatch's
    # activations at once.
    dominated_by = "1f1b"

    def device_order(self, device: int, num_devices: int, num_microbatches: int, chunks: int = 1) -> list[Work]:
        m = num_microbatches
        return [Work("F", 0, j) for j in range(m)] + [Work("B", 0, j) for j in range(m)]

    def in_flight(self, num_microbatches: int, position: int, num_stages: int, chunks: int = 1) -> int:
        return num_microbatches

    def step_time(self, stages: Sequence[StageTimes], num_microbatches: int, chunks: int = 1) -> float:
        """Two flow shops, every forward and then every backward: the first microbatch
        crosses every stage and link, the others follow at the pace of the slowest;
        then the slowest stage's gradient sync and optimizer."""
        m = num_microbatches
        sends = [s.send_s for s in stages[:-1]]
        fwd = [s.forward_s for s in stages]
        bwd = [s.backward_s for s in stages]
        tail = max(s.sync_s + s.optimizer_s for s in stages)
        forward = sum(fwd) + sum(sends) + (m - 1) * max(fwd + sends)
        backward = sum(bwd) + sum(sends) + (m - 1) * max(bwd + sends)
        return forward + backward + tail

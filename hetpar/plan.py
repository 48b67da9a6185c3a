"""Plan: where every part of the step runs. Plain data, printable for people."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StagePlan:
    index: int
    device_type: str
    device_ids: tuple[int, ...]
    layer_start: int
    layer_end: int  # exclusive
    layer_names: str
    flops: float  # forward + backward, full batch
    speed_flops: float  # the stage's peak FLOP/s (devices x per-device peak)
    predicted_time_s: float  # forward + backward of the full batch on this stage

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    num_microbatches: int
    num_layers: int
    cluster: str
    schedule: str = "gpipe"
    notes: tuple[str, ...] = field(default=())

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def predicted_step_time_s(self) -> float:
        """GPipe: the first microbatch crosses every stage, the rest follow at the
        pace of the slowest stage."""
        per_mb = [s.predicted_time_s / self.num_microbatches for s in self.stages]
        return sum(per_mb) + (self.num_microbatches - 1) * max(per_mb)

    def __str__(self) -> str:
        lines = [
            f"hetpar plan: {self.num_stages} stage(s) on {self.cluster}, {self.num_layers} layers, "
            f"{self.num_microbatches} microbatch(es), {self.schedule}",
            "  layers go to stages in proportion to stage speed (devices x peak FLOP/s), so stage times balance",
            f"  {'stage':>5}  {'device':<8} {'devices':>7} {'TFLOP/s':>8}  {'layers':<10} {'GFLOP':>9} {'time/step':>11}  modules",
        ]
        for s in self.stages:
            lines.append(
                f"  {s.index:>5}  {s.device_type:<8} {len(s.device_ids):>7} {s.speed_flops / 1e12:>8.1f}  "
                f"{f'{s.layer_start}-{s.layer_end - 1} ({s.num_layers})':<10} {s.flops / 1e9:>9.3f} "
                f"{_fmt_time(s.predicted_time_s):>11}  {s.layer_names}"
            )
        lines.append(f"  predicted step time {_fmt_time(self.predicted_step_time_s)} (compute only: FLOPs / peak)")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.3f} us"

"""A plan's step, simulated event by event, as people look at it: a Chrome/Perfetto
trace and a PNG timeline (stages as rows, microbatches labelled, the bubble as the
empty space between bars)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from hetpar.plan import Plan
from solver.pipeline_sim import MAX_SIMULATED_MICROBATCHES, Event, Simulation, pipeline_time, simulate

_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "transfer": "#8C8C8C", "sync": "#55A868", "optimizer": "#C44E52",
           "overlap": "#8DCB9B"}


@dataclass(frozen=True)
class StepBreakdown:
    step_s: float
    compute_s: float  # the busiest stage's forwards, backwards and optimizer
    communication_s: float  # it waits while data moves: transfers, its gradient sync
    bubble_s: float  # it waits on other stages' compute


def simulate_plan(plan: Plan) -> Simulation:
    """Every data-parallel pipeline of the plan, simulated side by side. Events name
    the plan's (global) stage numbers; a device group is named by its first stage
    (chunk 0), and `busy_s` follows `device_groups(plan)`."""
    if not plan.has_timings:
        raise ValueError("the plan has no per-stage timings to simulate; solve it again with this hetpar")
    if plan.num_microbatches > MAX_SIMULATED_MICROBATCHES:
        raise ValueError(
            f"the plan has {plan.num_microbatches} microbatches, more than the {MAX_SIMULATED_MICROBATCHES} simulated "
            f"event by event; its closed-form step time is {closed_form_s(plan):.6g} s (hetpar show prints it); "
            "to see a timeline, simulate a copy of the plan with fewer microbatches"
        )
    homes = device_groups(plan)
    events, busy, step = [], [0.0] * len(homes), 0.0
    for r in range(plan.num_replicas):
        stages = plan.replica_stages(r)
        sim = simulate([s.times for s in stages], plan.num_microbatches, plan.schedule, plan.chunks)
        glob = lambda i: None if i is None else stages[i].index  # noqa: E731
        for e in sim.events:
            events.append(replace(e, device=glob(e.device), stage=glob(e.stage), to_device=glob(e.to_device)))
        for g, b in enumerate(sim.busy_s):
            busy[homes.index(stages[g].index)] = b
        step = max(step, sim.step_s)
    for lead in plan.mixed_stages:  # each other part beside its lead, at its own pace
        for part in plan.parts(lead)[1:]:
            mine = [_part_event(e, part) for e in events if e.device == lead and e.kind != "transfer"]
            events += mine
            busy[homes.index(part.index)] = sum(e.end_s - e.start_s for e in mine if e.kind != "overlap")
    return Simulation(tuple(sorted(events, key=lambda e: (e.start_s, e.device))), step, tuple(busy))


def _part_event(e: Event, part) -> Event:  # noqa: ANN001
    """Event `e` of a mixed stage's lead as part `part` runs it: starting with the lead
    (the rows arrive together), lasting the part's own time for its rows (the
    position's time is its slowest part's, so a part never ends after it)."""
    own = {"forward": part.forward_s, "backward": part.backward_s, "sync": part.sync_s, "optimizer": part.optimizer_s}
    length = min(own.get(e.kind, e.end_s - e.start_s), e.end_s - e.start_s)
    return replace(e, device=part.index, stage=None if e.stage is None else part.index, end_s=e.start_s + length)


def device_groups(plan: Plan) -> list[int]:
    """The plan's device groups, each named by its first stage (its chunk 0)."""
    return [s.index for s in plan.stages if s.chunk == 0]


def breakdown(plan: Plan, sim: Simulation) -> StepBreakdown:
    """Splits the simulated step along its busiest device group: the time it computes
    is compute; the time it waits while data moves (a transfer or its gradient sync)
    is communication; the time it waits on other groups' compute is bubble."""
    homes = device_groups(plan)
    busiest = homes[max(range(len(homes)), key=lambda i: sim.busy_s[i])]
    # communication overlapped with compute (its own track) neither computes nor makes the group wait
    mine = [e for e in sim.events if e.device == busiest and e.kind not in ("transfer", "overlap")]
    working = [(e.start_s, e.end_s) for e in mine if e.kind != "sync"]
    moving = [(e.start_s, e.end_s) for e in sim.events if e.kind == "transfer"] + [(e.start_s, e.end_s) for e in mine if e.kind == "sync"]
    compute = _length(working)
    communication = _length(moving) - _overlap(moving, working)
    return StepBreakdown(sim.step_s, compute, communication, max(sim.step_s - compute - communication, 0.0))


def step_lines(plan: Plan, sim: Simulation) -> list[str]:
    """The step as `hetpar show` and `hetpar simulate` both print it: its time, where
    the busiest device group's time goes, and how idle the device groups are."""
    from hetpar.plan import fmt_time

    parts = breakdown(plan, sim)
    return [fmt_time(sim.step_s),
            f"busiest stage: compute {fmt_time(parts.compute_s)}, communication {fmt_time(parts.communication_s)}, "
            f"bubble (waiting on other stages) {fmt_time(parts.bubble_s)}",
            f"stages idle {sim.bubble_fraction:.1%} of the step"]


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in _merged(intervals))


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total = 0.0
    for s1, e1 in _merged(a):
        for s2, e2 in _merged(b):
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


def closed_form_s(plan: Plan) -> float:
    """The planner's closed-form step time, for comparison with the simulation."""
    return max(
        pipeline_time([s.times for s in plan.replica_stages(r)], plan.num_microbatches, plan.schedule, plan.chunks)
        for r in range(plan.num_replicas)
    )


def sync_algorithms(plan: Plan) -> dict[int, str]:
    """Per stage index, the algorithms its once-per-step gradient collectives run
    (`hetpar.plan.collectives`, the estimator's choice), for the timeline's sync bars."""
    from hetpar.plan.collectives import plan_collectives

    found: dict[int, list[str]] = {}
    for u in plan_collectives(plan):
        if u.stage is not None and not u.purpose.startswith("tensor-parallel") and u.algorithm not in found.get(u.stage, []):
            found.setdefault(u.stage, []).append(u.algorithm)
    return {stage: " + ".join(names) for stage, names in found.items()}


def write_chrome_trace(sim: Simulation, path: str | Path, algorithms: dict[int, str] | None = None) -> None:
    """Chrome trace event format (open in chrome://tracing or ui.perfetto.dev).
    `algorithms` (`sync_algorithms`): named in each gradient sync's arguments."""
    lanes = _lanes(sim)
    events = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": _lane_name(lane)}} for i, lane in enumerate(lanes)
    ]
    for e in sim.events:
        args = {"microbatch": e.microbatch, "stage": e.stage, "chunk": e.chunk}
        if e.kind in ("sync", "overlap") and algorithms and e.device in algorithms:
            args["algorithm"] = algorithms[e.device]
        events.append({
            "name": e.name, "cat": e.kind, "ph": "X", "pid": 0, "tid": lanes.index(_lane(e)),
            "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6, "args": args,
        })
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def plot_timeline(plan: Plan, sim: Simulation, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = _lanes(sim)
    algorithms = sync_algorithms(plan)
    unit, scale = _unit(sim.step_s)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(lanes) + 1.6))
    for e in sim.events:
        row = len(lanes) - 1 - lanes.index(_lane(e))
        start, width = e.start_s * scale, (e.end_s - e.start_s) * scale
        ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=_COLORS[e.kind], edgecolor="white", linewidth=0.5)
        label = e.name if e.kind in ("forward", "backward") else ("" if e.kind == "transfer" else e.kind)
        if e.kind == "sync" and e.device in algorithms:
            label = f"sync ({algorithms[e.device]})"
        if label and width > sim.step_s * scale / 80:
            ax.text(start + width / 2, row, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([_lane_label(plan, lane) for lane in reversed(lanes)])
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, sim.step_s * scale * 1.01)
    ax.set_title(
        f"{plan.schedule}{f' ({plan.chunks} chunks per device group)' if plan.chunks > 1 else ''}, {plan.num_stages} stages, {plan.num_microbatches} microbatches: step {sim.step_s * scale:.3g} {unit}, "
        f"bubble {sim.bubble_fraction:.0%} of stage time (white space)"
    )
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], loc="upper right", fontsize=8, ncol=5)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


Lane = tuple[int, ...]  # (device group,) for compute rows, (sender, receiver) for links, (group, COMM) for overlap
COMM = -1  # the second entry of a device group's track of communication overlapped with its compute


def _lane(e: Event) -> Lane:
    if e.kind == "overlap":
        return (e.device, COMM)
    return (e.device, e.to_device) if e.kind == "transfer" else (e.device,)


def _lanes(sim: Simulation) -> list[Lane]:
    """Each device group, then the links leaving it."""
    lanes = sorted({_lane(e) for e in sim.events})
    out: list[Lane] = []
    for group in (lane for lane in lanes if len(lane) == 1):
        out += [group] + [link for link in lanes if len(link) == 2 and link[0] == group[0]]
    return out


def _lane_name(lane: Lane) -> str:
    if len(lane) == 2 and lane[1] == COMM:
        return f"stage {lane[0]} data-parallel comm (overlapped)"
    return f"stage {lane[0]}" if len(lane) == 1 else f"link {lane[0]}->{lane[1]}"


def _lane_label(plan: Plan, lane: Lane) -> str:
    if len(lane) == 2:
        return _lane_name(lane)
    s = plan.stages[lane[0]]
    replica = f" (replica {s.replica}, {s.batch_share:.0%} of batch)" if plan.num_replicas > 1 else ""
    chunks = [c.index for c in plan.stages if c.device_ids == s.device_ids]
    name = f"stage {s.index}" if len(chunks) == 1 else f"stages {', '.join(map(str, chunks))}"
    lead = s.lead
    parts = plan.parts(lead)
    if parts:  # a mixed stage's part: which stage, which part, its rows
        name = f"stage {lead} part {[q.index for q in parts].index(s.index)}"
        replica += f" ({s.examples} of each microbatch's {sum(q.examples for q in parts)} examples)"
    return f"{name}: {s.num_devices}x{s.device_type}{replica}"


def _unit(seconds: float) -> tuple[str, float]:
    if seconds >= 1:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e3
    return "us", 1e6

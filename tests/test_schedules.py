"""Schedules as one registry, proven by interleaved 1F1B: its orders, its closed form
against the simulator, the planner choosing it when it predicts a smaller bubble, its
plans checked, simulated, drawn and run with parity, and no schedule name listed
outside the registry."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

import hetpar
from hetpar.compile.order import order
from hetpar.errors import PlanError
from hetpar.plan.file import load_plan, plan_from_dict, plan_to_dict, save_plan
from hetpar.timeline import breakdown, closed_form_s, plot_timeline, simulate_plan
from models import gpt
from parity import run_parity
from solver import schedules
from solver.collectives import LinkCost
from solver.pipeline_sim import StageTimes, pipeline_time, simulate
from solver.planner import DeviceKind, LayerCost, PlanningError, Problem, plan
from solver.cost.stage_costs import in_flight

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
TWO_TYPES = {"A100": 4, "V100": 4}
THREE_TYPES = {"H100": 2, "A100": 2, "V100": 4}


# --- the registry ---------------------------------------------------------------------

def test_the_registry_knows_every_schedule_and_names_the_unknown():
    assert set(schedules.names()) == {"gpipe", "1f1b", "interleaved"}
    assert schedules.get("interleaved").interleaved and not schedules.get("1f1b").interleaved
    with pytest.raises(ValueError, match="unknown schedule 'zb-h1'; known: gpipe, 1f1b, interleaved"):
        schedules.get("zb-h1")
    with pytest.raises(ValueError, match="unique name"):
        schedules.register(schedules.get("gpipe"))


SHAPES = [(d, v, m) for d in (2, 3, 4) for v in (2, 3, 4) for m in (d, 2 * d, 3 * d)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_every_device_runs_each_chunk_and_microbatch_once_each_way(name):
    for d, v, m in SHAPES:
        v = v if schedules.get(name).interleaved else 1
        for device in range(d):
            work = schedules.get(name).device_order(device, d, m, v)
            want = sorted((k, c, j) for k in "FB" for c in range(v) for j in range(m))
            assert sorted((w.kind, w.chunk, w.microbatch) for w in work) == want, (name, d, v, m, device)


def test_interleaved_refuses_what_megatron_cannot_run():
    with pytest.raises(ValueError, match="multiple"):
        simulate([StageTimes(1, 2)] * 4, 3, "interleaved", 2)
    with pytest.raises(ValueError, match="at least 2 chunks"):
        simulate([StageTimes(1, 2)] * 2, 2, "interleaved", 1)
    with pytest.raises(ValueError, match="one chunk per device group"):
        simulate([StageTimes(1, 2)] * 4, 2, "1f1b", 2)


# --- the simulator against the closed form -------------------------------------------

@pytest.mark.parametrize("d,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 3, 6), (2, 4, 2), (4, 2, 4)])
def test_interleaved_bubble_is_one_f_one_b_bubble_over_the_chunks(d, v, m):
    """Equal chunks, free sends: 1F1B idles (D - 1) stage-times, interleaving (D - 1) / v."""
    f, b = 1.0, 2.0
    sim = simulate([StageTimes(f / v, b / v)] * (d * v), m, "interleaved", v)
    expected = m * (f + b) + (d - 1) * (f + b) / v
    assert sim.step_s == pytest.approx(expected)
    assert pipeline_time([StageTimes(f / v, b / v)] * (d * v), m, "interleaved", v) == pytest.approx(expected)
    one_f = simulate([StageTimes(f, b)] * d, m, "1f1b")
    assert one_f.step_s == pytest.approx(m * (f + b) + (d - 1) * (f + b))
    assert sim.bubble_fraction == pytest.approx((d - 1) / v / (m + (d - 1) / v))
    assert sim.bubble_fraction < one_f.bubble_fraction


def test_interleaved_closed_form_is_close_on_uneven_stages_with_sends():
    import random

    rng = random.Random(0)
    for d, v, m in [(2, 2, 4), (4, 2, 8), (3, 3, 6), (2, 3, 8), (4, 4, 4)]:
        stages = [StageTimes(rng.uniform(.1, .3), rng.uniform(.2, .6), rng.uniform(0, .05), .01, .02) for _ in range(d * v)]
        simulated = simulate(stages, m, "interleaved", v).step_s
        assert pipeline_time(stages, m, "interleaved", v) == pytest.approx(simulated, rel=0.06), (d, v, m)
    # equal chunks and sends: every send lies on the fill, as the closed form says
    stages = [StageTimes(.15, .25, .05)] * 8
    assert pipeline_time(stages, 8, "interleaved", 2) == pytest.approx(simulate(stages, 8, "interleaved", 2).step_s)


@pytest.mark.parametrize("k,m,send", [(3, 12, 0.4), (4, 16, 0.5), (6, 24, 0.3), (8, 32, 0.4)])
def test_one_f_one_b_is_paced_by_its_round_trips_where_sends_are_large(k, m, send):
    """A first stage keeps k microbatches in flight, so one that crosses every stage
    and link both ways takes k microbatches' turns: with sends as slow as the stages
    that round trip, not the slowest stage or link, sets the pace (the simulation's
    step is 36-50% above the slowest-stage form on these), and the closed form follows
    the simulation within 2%."""
    stages = [StageTimes(0.3, 0.7, send if p < k - 1 else 0.0) for p in range(k)]
    simulated = simulate(stages, m, "1f1b").step_s
    once = k * 1.0 + 2 * (k - 1) * send
    assert simulated > (once + (m - 1) * max(1.0, send)) * 1.3  # what the form without round trips says
    assert pipeline_time(stages, m, "1f1b") == pytest.approx(once + (m - 1) * once / k)
    assert pipeline_time(stages, m, "1f1b") == pytest.approx(simulated, rel=0.02)
    # With no more microbatches than stages the first stage never waits for one back.
    assert pipeline_time(stages, k, "1f1b") == pytest.approx(once + (k - 1) * max(1.0, send))


def test_interleaved_events_are_structured():
    sim = simulate([StageTimes(1, 2, 0.1)] * 6, 3, "interleaved", 2)
    compute = [e for e in sim.events if e.kind in ("forward", "backward")]
    assert {(e.stage % 3, e.device) for e in compute} == {(0, 0), (1, 1), (2, 2)}
    assert {e.chunk for e in compute} == {0, 1} and all(e.chunk == e.stage // 3 for e in compute)
    sends = [e for e in sim.events if e.kind == "transfer"]
    assert {(e.device, e.to_device) for e in sends} == {(0, 1), (1, 2), (2, 0), (1, 0), (2, 1), (0, 2)}
    assert len(sim.busy_s) == 3


@pytest.mark.parametrize("d,v,m", [(2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 4, 8), (2, 2, 2)])
def test_in_flight_covers_what_each_device_holds_in_the_simulation(d, v, m):
    """Per device group, the activations its chunks hold at the worst moment (forwards
    done, backwards not yet) fit in what the memory model charges its chunks."""
    sim = simulate([StageTimes(1, 2)] * (d * v), m, "interleaved", v)
    for g in range(d):
        held, peak = 0, 0
        for e in sorted((e for e in sim.events if e.device == g and e.kind != "transfer"), key=lambda e: e.start_s):
            held += 1 if e.kind == "forward" else -1
            peak = max(peak, held)
        charged = sum(in_flight("interleaved", m, c * d + g, d * v, v) for c in range(v))
        assert peak <= charged <= peak + v, (g, peak, charged)
    # Megatron's count for device 0 of 4 with 2 chunks: 2 (D - 1) + (v - 1) D warm-up forwards, plus one
    assert in_flight("interleaved", 8, 0, 8, 2) == 6 and in_flight("interleaved", 8, 3, 8, 2) == 3
    assert in_flight("interleaved", 2, 0, 8, 2) == 2  # never more than the microbatches


# --- the dispatch order ---------------------------------------------------------------

@dataclasses.dataclass
class _Task:
    stage: int
    kind: str


@dataclasses.dataclass
class _Program:
    task: _Task


def test_dispatch_order_interleaves_chunks_as_megatron():
    """Two device groups, two chunks each: group 0 runs both chunks' forwards of the
    first microbatch group before the next group's, and every program follows its inputs."""
    programs = [_Program(_Task(s, kind)) for s in range(4) for kind in (("fwd", "bwd") if s < 3 else ("fwd",))]
    steps = order(programs, 4, "interleaved", 2)
    middle = [(programs[s.program].task.stage, programs[s.program].task.kind, s.microbatch) for s in steps if s.microbatch is not None]
    on_group_0 = [x for x in middle if x[0] % 2 == 0 and x[1] == "fwd"]
    assert on_group_0[:4] == [(0, "fwd", 0), (0, "fwd", 1), (2, "fwd", 0), (2, "fwd", 1)]
    seen = set()
    for stage, kind, mb in middle:
        if kind == "fwd" and stage > 0:
            assert (stage - 1, "fwd", mb) in seen
        if kind == "bwd":
            assert (stage + 1, "bwd" if stage + 1 < 3 else "fwd", mb) in seen
        seen.add((stage, kind, mb))
    assert len(middle) == 4 * 7


# --- the planner ----------------------------------------------------------------------

def _bubble_problem(schedules_allowed):
    """Four equal devices on fast links, eight equal layers of which a device holds
    two at most without ZeRO (so the pipeline has four stages), a batch in four
    microbatches: 1F1B's bubble is three stage-times of seven; interleaving halves it."""
    layer = LayerCost(1e12, 1e12 / 3, 8 * GIB, 2**20, 2**10)
    link = LinkCost(1e12, 1e-7)
    kind = DeviceKind("gpu", 4, 4, 1e13, 80 * GIB, 1e12, link, link)
    return Problem((layer,) * 8, (kind,), 16, microbatches=(4,), schedules=schedules_allowed, allow_replicas=False, max_tp=1,
                   zero_stages=(0,))


def test_the_planner_picks_interleaved_when_it_predicts_a_smaller_bubble():
    best = plan(_bubble_problem(schedules.names())).best
    assert best.schedule == "interleaved" and best.chunks == 2, best.describe()
    one_f = plan(_bubble_problem(("1f1b", "gpipe"))).best
    assert one_f.schedule == "1f1b"
    assert best.step_s < one_f.step_s
    # the bubble it predicts is the simulator's: smaller under interleaving
    times = lambda c: [StageTimes(s.forward_s, s.backward_s, s.send_s, s.sync_s, s.optimizer_s) for s in c.stages]  # noqa: E731
    inter = simulate(times(best), 4, "interleaved", 2)
    plain = simulate(times(one_f), 4, "1f1b")
    assert inter.bubble_fraction < plain.bubble_fraction
    assert inter.step_s == pytest.approx(best.step_s, rel=0.02)


def test_the_planner_keeps_one_f_one_b_when_sends_cost_more_than_the_bubble():
    problem = _bubble_problem(schedules.names())
    slow = LinkCost(1e10, 1e-3)  # a microbatch of 4 GiB takes 0.43 s: interleaving's extra sends cost more than it saves
    kind = dataclasses.replace(problem.kinds[0], intra=slow, inter=slow)
    layers = tuple(dataclasses.replace(layer, input_bytes=GIB) for layer in problem.layers)
    best = plan(dataclasses.replace(problem, kinds=(kind,), layers=layers)).best
    assert best.schedule != "interleaved", best.describe()


# --- plans: hand-made, checked, saved, simulated, drawn, run -------------------------

@pytest.fixture(scope="module")
def tiny_gpt():
    return gpt.setup(batch_size=12, config=gpt.GPTConfig(n_layers=4, d_model=16, n_heads=2))


PARITY = [
    # (cluster, device groups, chunks, microbatches, layers)
    (TWO_TYPES, 2, 2, 4, 4),
    (TWO_TYPES, 2, 4, 6, 8),
    (THREE_TYPES, 3, 2, 3, 6),
    (THREE_TYPES, 3, 3, 6, 9),
]


@pytest.mark.parametrize("case", PARITY, ids=lambda c: f"{'+'.join(c[0])}-g{c[1]}-v{c[2]}-mb{c[3]}")
def test_interleaved_parity(tiny_gpt, case):
    counts, groups, chunks, mbs, layers = case
    used = run_parity(tiny_gpt, hetpar.Cluster.virtual(counts), steps=2, num_stages=groups, num_microbatches=mbs,
                      num_layers=layers, schedule="interleaved", chunks=chunks)
    assert used.schedule == "interleaved" and used.chunks == chunks and used.num_stages == groups * chunks
    for s in used.stages:  # stage i is chunk i // groups on group i mod groups
        assert s.chunk == s.index // groups and s.device_ids == used.stages[s.index % groups].device_ids
    assert len({s.device_type for s in used.stages}) == len(counts)


def test_the_planner_alone_with_interleaved_gives_a_plan_that_runs(tiny_gpt):
    """`schedule="interleaved"` without a stage count: the planner's own interleaved
    plan (it once refused: "no plan fits in memory"), run against jax.jit."""
    used = run_parity(tiny_gpt, hetpar.Cluster.virtual(TWO_TYPES), steps=1, num_microbatches=4, num_layers=4,
                      schedule="interleaved")
    assert used.schedule == "interleaved" and used.chunks >= 2 and used.num_stages >= 4


@pytest.fixture(scope="module")
def interleaved_plan(tiny_gpt):
    return hetpar.make_plan(tiny_gpt.step, (tiny_gpt.state, tiny_gpt.batch), hetpar.Cluster.virtual(TWO_TYPES),
                            num_microbatches=4, num_stages=2, num_layers=4, schedule="interleaved", chunks=2)


def test_an_interleaved_plan_round_trips_and_draws(interleaved_plan, tmp_path):
    save_plan(interleaved_plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == interleaved_plan
    sim = simulate_plan(interleaved_plan)
    assert len(sim.busy_s) == 2  # one row per device group, not per chunk
    assert {e.device for e in sim.events} == {0, 1} and {e.stage for e in sim.events if e.stage is not None} == {0, 1, 2, 3}
    assert closed_form_s(interleaved_plan) == pytest.approx(sim.step_s, rel=0.1)
    parts = breakdown(interleaved_plan, sim)
    assert parts.compute_s > 0 and parts.step_s == sim.step_s
    plot_timeline(interleaved_plan, sim, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    assert "2 chunks per device group" in str(interleaved_plan)


def _edited(plan, edit):
    raw = json.loads(json.dumps(plan_to_dict(plan)))
    edit(raw)
    return raw


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.update(schedule="1f1b"), "runs one chunk per device group"),
    (lambda r: r["stages"][2].update(chunk=0), "stage 2 must be chunk 1"),
    (lambda r: [r.update(schedule="1f1b")] + [s.update(chunk=0) for s in r["stages"]], "two stages share a device"),
    (lambda r: r["stages"][2].update(device_ids=r["stages"][1]["device_ids"]), "must be chunk 1 on the devices of stage 0"),
    (lambda r: r.update(num_microbatches=3), "not a multiple"),
])
def test_plan_files_accept_shared_devices_only_as_chunks(interleaved_plan, edit, message):
    assert plan_from_dict(_edited(interleaved_plan, lambda r: None)) == interleaved_plan
    with pytest.raises(PlanError, match=message):
        plan_from_dict(_edited(interleaved_plan, edit))


def test_chunks_need_an_interleaved_schedule(tiny_gpt):
    with pytest.raises(PlanError, match="use schedule='interleaved'"):
        hetpar.parallelize(tiny_gpt.step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, schedule="1f1b", chunks=2)
    with pytest.raises(PlanError, match="not a multiple"):
        hetpar.make_plan(tiny_gpt.step, (tiny_gpt.state, tiny_gpt.batch), hetpar.Cluster.virtual(TWO_TYPES),
                         num_microbatches=3, num_stages=2, num_layers=4, schedule="interleaved", chunks=2)


# --- one list of names ----------------------------------------------------------------

def test_schedule_names_are_listed_only_in_the_registry():
    """Outside solver/schedules/, code asks the registry: no schedule name appears as
    a string literal in hetpar/ or solver/."""
    names = "|".join(re.escape(n) for n in schedules.names())
    literal = re.compile(rf"""(["'])({names})\1""")
    offenders = []
    for package in ("hetpar", "solver"):
        for path in (ROOT / package).rglob("*.py"):
            if path.is_relative_to(ROOT / "solver" / "schedules"):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if literal.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "schedule names outside the registry:\n" + "\n".join(offenders)


def test_the_planner_plans_interleaved_alone():
    """`--schedule interleaved` alone once found nothing ("no plan fits in memory"):
    interleaving only refined orders whose plain pipeline had made the top k, and
    with no plain schedule allowed none ever did."""
    best = plan(_bubble_problem(("interleaved",))).best
    assert best.schedule == "interleaved" and best.chunks >= 2, best.describe()
    assert best.step_s <= plan(_bubble_problem(schedules.names())).best.step_s * (1 + 1e-9)


@pytest.mark.parametrize("layers, microbatches, reason", [
    (3, (4,), r"interleaved with 2 chunks per device group: .*at least 2 device groups.*3 planning layers allow at most 1"),
    (8, (1,), r"runs microbatches in groups of the \d device groups; 1 microbatches is not a multiple"),
])
def test_the_planner_names_why_no_interleaved_pipeline_can_exist(layers, microbatches, reason):
    problem = dataclasses.replace(_bubble_problem(("interleaved",)), microbatches=microbatches)
    problem = dataclasses.replace(problem, layers=problem.layers[:layers])
    with pytest.raises(PlanningError, match=reason) as caught:
        plan(problem)
    assert "fits in memory" not in str(caught.value)

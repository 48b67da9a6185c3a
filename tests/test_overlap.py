"""Data-axis collectives overlapped with compute (`Problem.overlap_comm`): only the
exposed part is priced, ZeRO-2's reduce-scatter runs once per step, and the hidden
part is drawn on its own track."""

from __future__ import annotations

import numpy as np
import pytest

from solver.collectives import LinkCost
from solver.cost.estimate import Decisions, StageDecision, estimate
from solver.cost.problem import DeviceKind, LayerCost, Problem
from solver.cost.topologies import exposed

GIB = 2**30
KIND = DeviceKind("gpu", 16, 8, 1e14, 80 * GIB, 2e12, LinkCost(200e9, 2e-6), LinkCost(25e9, 5e-6))
LAYER = LayerCost(3e12, 1e12, 256 * 2**20, 2**20, 2**16)


def _price(overlap: bool, zero: int = 0, m: int = 1, layers: int = 8):
    problem = Problem((LAYER,) * layers, (KIND,), 64, overlap_comm=overlap)
    return estimate(problem, Decisions((StageDecision("gpu", 16, 1, 0, layers, zero=zero),), m, "1f1b", (64,)))


def _buckets_event_by_event(comm: list[float], compute: list[float]) -> float:
    """Backward runs layers last to first; each layer's bucket starts when its
    backward is done and the stream is free. Returns what shows after the compute."""
    t, stream = 0.0, 0.0
    for c, p in zip(reversed(comm), reversed(compute)):
        t += p
        stream = max(stream, t) + c
    return max(stream - t, 0.0)


@pytest.mark.parametrize("c, p", [(1.0, 3.0), (3.0, 1.0), (2.0, 2.0), (0.5, 0.1)])
def test_exposed_matches_the_buckets_run_event_by_event(c, p):
    n = 6
    want = _buckets_event_by_event([c] * n, [p] * n)
    got = exposed(np.array(n * c), np.array(c), np.array(n * p), np.array(p))
    assert float(got) == pytest.approx(want)
    assert float(got) == pytest.approx(c + (n - 1) * max(c - p, 0.0))


def test_overlapped_gradient_reduction_exposes_less_than_serial():
    serial, overlapped = _price(False), _price(True)
    s, o = serial.stages[0], overlapped.stages[0]
    assert o.sync_s < s.sync_s  # only the last bucket shows: the backward hides the rest
    assert o.overlapped_s > 0 and o.sync_s + o.overlapped_s >= s.sync_s  # buckets pay a latency each
    assert overlapped.step_s < serial.step_s
    assert (o.forward_s, o.backward_s) == (s.forward_s, s.backward_s)  # compute is unchanged


def test_zero2_reduce_scatter_is_priced_once_per_step():
    one, four = _price(True, zero=2, m=1), _price(True, zero=2, m=4)
    plain = _price(True, zero=0, m=4)
    # per microbatch the backward carries no reduce-scatter; the step's tail is the same whatever m
    assert four.stages[0].backward_s == pytest.approx(plain.stages[0].backward_s)
    assert four.stages[0].sync_s == pytest.approx(one.stages[0].sync_s)
    assert four.stages[0].overlapped_s == pytest.approx(one.stages[0].overlapped_s) and four.stages[0].overlapped_s > 0
    # serially (hetpar's runtime), every microbatch's backward reduce-scatters
    serial = _price(False, zero=2, m=4)
    assert serial.stages[0].backward_s > plain.stages[0].backward_s


def test_zero3_gathers_are_prefetched():
    serial, overlapped = _price(False, zero=3, m=4), _price(True, zero=3, m=4)
    compute = _price(True, zero=0, m=4).stages[0]
    o, s = overlapped.stages[0], serial.stages[0]
    assert compute.forward_s < o.forward_s < s.forward_s  # the first layer's gather still shows
    assert compute.backward_s < o.backward_s < s.backward_s


def test_a_single_device_stage_has_nothing_to_overlap():
    problem = Problem((LAYER,) * 4, (KIND,), 64, overlap_comm=True)
    cost = estimate(problem, Decisions((StageDecision("gpu", 1, 1, 0, 4),), 1, "1f1b", (64,)))
    assert cost.stages[0].sync_s == 0 and cost.stages[0].overlapped_s == 0


def test_overlapped_communication_has_its_own_track():
    from hetpar.timeline import _lane, _lane_name

    sim = _price(True, m=2).simulations[0]
    hidden = [e for e in sim.events if e.kind == "overlap"]
    assert len(hidden) == 1
    last_backward = max((e for e in sim.events if e.kind == "backward"), key=lambda e: e.end_s)
    assert hidden[0].end_s == pytest.approx(last_backward.end_s) and hidden[0].start_s >= last_backward.start_s
    assert _lane(hidden[0]) != _lane(last_backward) and "overlapped" in _lane_name(_lane(hidden[0]))
    assert not [e for e in _price(False, m=2).simulations[0].events if e.kind == "overlap"]


@pytest.mark.parametrize("seed", range(8))
def test_no_plan_beats_the_planner_when_collectives_overlap(seed):
    """The planner's bounds stay below what `_overlapped` charges: brute force finds
    nothing faster (tests/test_planner.py's random problems, overlap on)."""
    from dataclasses import replace

    from solver.planner import PlanningError, plan
    from tests.test_planner import INF, brute_force, closed_form_step_s, random_problem

    # Mixed-kind stages off: brute force enumerates one kind per stage, the space the bounds cover.
    problem = replace(random_problem(np.random.default_rng(100 + seed), allow_replicas=False), overlap_comm=True,
                      allow_mixed=False)
    expected = brute_force(problem)
    if expected == INF:
        with pytest.raises(PlanningError):
            plan(problem)
        return
    result = plan(problem)
    closed = min(closed_form_step_s(c) for c in (result.best, *result.alternatives))
    assert closed == pytest.approx(expected, rel=1e-9)


def test_the_chrome_trace_names_the_overlap_track(tmp_path):
    import json

    from hetpar.timeline import write_chrome_trace

    write_chrome_trace(_price(True, m=2).simulations[0], tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert "stage 0 data-parallel comm (overlapped)" in names
    assert any(e.get("cat") == "overlap" for e in trace)

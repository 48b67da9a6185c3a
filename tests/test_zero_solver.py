"""solver.zero: ZeRO's memory and collective prices, and the per-parameter choice,
on synthetic sizes (no jax)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from solver.collectives import LinkCost, Topology, best
from solver.zero import ZeroItem, choose_zero, state_bytes_per_device, zero_comm_time, zero_time

LINK = LinkCost(100e9, 5e-6)
TOPO = Topology(1, 4, LINK, LINK)


def test_state_bytes_per_stage():
    # Mixed precision Adam: 2 bytes of parameter, 2 of gradient, 12 of optimizer state.
    held = [state_bytes_per_device(2.0, 12.0, 2.0, 4, z) for z in range(4)]
    assert held == [16.0, 2 + 2 + 3.0, 2 + 0.5 + 3.0, 0.5 + 0.5 + 3.0]
    assert state_bytes_per_device(2.0, 12.0, 2.0, 1, 3) == 16.0  # one device: nothing to split


def test_comm_time_per_stage():
    """A replicated gradient is all-reduced once per step, a sharded one reduce-scattered
    per microbatch; ZeRO-1/2 all-gather the updated parameters once, ZeRO-3 gathers
    them for every forward and backward."""
    g = p = 1e8
    ar, rs, ag = (best(k, TOPO, 1e8)[1] for k in ("all_reduce", "reduce_scatter", "all_gather"))
    assert zero_comm_time(p, g, 4, 0, TOPO, microbatches=3) == pytest.approx(ar)
    assert zero_comm_time(p, g, 4, 1, TOPO, microbatches=3) == pytest.approx(ar + ag)
    assert zero_comm_time(p, g, 4, 2, TOPO, microbatches=3) == pytest.approx(3 * rs + ag)
    assert zero_comm_time(p, g, 4, 3, TOPO, microbatches=3) == pytest.approx(3 * (rs + 2 * ag))
    assert zero_comm_time(p, g, 1, 3, TOPO) == 0.0
    # Over nodes, the vectorized price (what the planner's tables use) is `best`'s, hierarchical included.
    two_nodes = Topology(2, 4, LINK, LinkCost(12.5e9, 1e-5))
    for zero in range(4):
        times = zero_time(np.array([1e6, 1e8]), np.array([1e6, 1e8]), zero, two_nodes)
        ar, rs, ag = (best(k, two_nodes, 1e8)[1] for k in ("all_reduce", "reduce_scatter", "all_gather"))
        want = {0: (0, 0, ar), 1: (0, 0, ar + ag), 2: (0, rs, ag), 3: (ag, ag + rs, 0)}[zero]
        assert (times.forward[1], times.backward[1], times.step[1]) == pytest.approx(want)


@pytest.mark.parametrize("bad", [dict(zero=4), dict(dp=0)])
def test_bad_stage_or_axis_is_refused(bad):
    args = dict(param_bytes=1.0, opt_bytes=1.0, grad_bytes=1.0, dp=4, zero=1) | bad
    with pytest.raises(ValueError):
        state_bytes_per_device(**args)


def _held(items, levels, dp=4):
    return sum(state_bytes_per_device(i.param_bytes, i.opt_bytes, i.grad_bytes, dp, z) for i, z in zip(items, levels))


def _time(items, levels, dp=4, m=2):
    return sum(zero_comm_time(i.param_bytes, i.grad_bytes, dp, z, TOPO, m) for i, z in zip(items, levels))


ITEMS = [ZeroItem(4e6, 8e6, 4e6), ZeroItem(4e8, 8e8, 4e8), ZeroItem(1e3, 2e3, 1e3), ZeroItem(4e7, 8e7, 4e7, shardable=False)]


def test_without_pressure_state_stays_whole():
    assert choose_zero(ITEMS, 4, TOPO, 2) == [0, 0, 0, 0]
    assert choose_zero(ITEMS, 4, TOPO, 2, budget_bytes=1e12) == [0, 0, 0, 0]
    assert choose_zero(ITEMS, 4, TOPO, 2, floor=2) == [2, 2, 2, 0]  # the unshardable one stays whole


@pytest.mark.parametrize("fraction", [0.9, 0.6, 0.4, 0.3])
def test_choice_fits_and_is_near_the_cheapest_that_fits(fraction):
    """Against brute force over every per-parameter assignment: the greedy choice
    fits whenever anything does, and the large parameter is sharded before the small
    ones (it frees the most memory per second of collectives)."""
    budget = fraction * _held(ITEMS, [0] * 4)
    levels = choose_zero(ITEMS, 4, TOPO, 2, budget_bytes=budget)
    assert levels[3] == 0
    fitting = [c for c in itertools.product(range(4), range(4), range(4), [0]) if _held(ITEMS, c) <= budget]
    if fitting:
        assert _held(ITEMS, levels) <= budget
        cheapest = min(_time(ITEMS, c) for c in fitting)
        assert _time(ITEMS, levels) <= 2 * cheapest + 1e-9
        assert levels[1] >= max(levels[0], levels[2])
    else:
        assert levels[:3] == [3, 3, 3]


def test_nothing_fits_ends_at_zero3():
    assert choose_zero(ITEMS, 4, TOPO, 2, budget_bytes=1.0) == [3, 3, 3, 0]

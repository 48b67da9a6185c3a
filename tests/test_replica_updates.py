"""Data-parallel replicas each update their own copy of the state: every replica sums
all replicas' shares in one order, runs the update on its own stages, and keeps its
copy between calls, so a next step moves no parameters from replica 0 into another
replica (the copy the estimator never priced). Parity with jax.jit over three steps."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import hetpar
from hetpar.options import ShardingOption, StageOption
from models import mlp
from parity import assert_close, run_parity, with_grads

THREE_KINDS = {"H100": 2, "A100": 2, "V100": 2}


class _Moves:
    """The device path with every move recorded (source, target sharding, whether
    the replicas' combine made it)."""

    def __init__(self, path):
        self.path, self.seen, self.combining = path, [], False

    def to_mesh(self, x, sharding):
        self.seen.append((x, sharding, self.combining))
        return self.path.to_mesh(x, sharding)

    def __getattr__(self, name):
        return getattr(self.path, name)


def _kind(x) -> tuple:
    return np.shape(x), np.dtype(getattr(x, "dtype", type(x)))


@pytest.mark.parametrize("zero, stages", [(1, 1), (3, 1), (2, 2)])
def test_replicas_under_zero_parity(zero, stages):
    """Two replicas of different kinds (uneven batch shares), each stage's state sharded
    over its own data axis: each replica's update runs on its own shards."""
    plan = run_parity(mlp.setup(batch_size=16, hidden=32, depth=3), hetpar.Cluster.virtual({"A100": 4, "V100": 4}),
                      num_replicas=2, num_stages=stages, num_layers=4, num_microbatches=2,
                      stage_option=StageOption(mode="uniform"), sharding_option=ShardingOption(zero=zero))
    assert plan.num_replicas == 2 and len(plan.replica_stages(1)) == stages
    assert all(s.zero == zero and any("data" in spec for _, spec in s.shardings) for s in plan.stages)


def test_every_replica_updates_its_own_state_and_a_next_step_copies_none_of_it(monkeypatch):
    """Three replicas of three kinds, uneven shares: after step 1 replicas 1 and 2 each
    hold their own new state, bit for bit replica 0's; step 2 moves none of the returned
    state onto their devices; state the caller changed is copied from the arguments."""
    from hetpar.runtime import executor, interpreter
    w = mlp.setup(batch_size=16, hidden=32, depth=3)
    cluster = hetpar.Cluster.virtual(THREE_KINDS)
    step = with_grads(w.loss_fn)
    parallel = hetpar.parallelize(step, cluster=cluster, num_replicas=3, num_stages=1, num_microbatches=2)
    reference = jax.jit(step)
    moves = _Moves(executor._PATH)
    monkeypatch.setattr(executor, "_PATH", moves)
    combine = interpreter.combine_replicas

    def combining(*args):
        moves.combining = True
        try:
            return combine(*args)
        finally:
            moves.combining = False
    monkeypatch.setattr(interpreter, "combine_replicas", combining)

    def copied_into(state, replica: int) -> int:
        """Moves onto replica `replica`'s devices of `state`'s arrays (the call's
        arguments) or of replica 0's copies of them, outside the replicas' sum of the
        gradients (whose moves are the all-reduce, and expected)."""
        compiled = parallel.compiled()
        devices = lambda r: {d for p, q in zip(compiled.programs, compiled.replica_of) if q == r for d in p.mesh.devices.flat}  # noqa: E731
        mine, first = devices(replica), devices(0)
        args = {id(x) for x in jax.tree.leaves(state)}
        shapes = {_kind(x) for x in jax.tree.leaves(state)}
        return sum(1 for x, target, combining in moves.seen if not combining and set(target.device_set) <= mine and (
            id(x) in args or (_kind(x) in shapes and set(x.sharding.device_set) <= first)))

    def both(par_state, ref_state, what):
        moves.seen.clear()
        par, ref = parallel(par_state, w.batch), reference(ref_state, w.batch)
        for a, e, name in zip(par, ref, ("state", "loss", "gradients")):
            assert_close(a, e, f"{name}, {what}")
        return par[0], ref[0], [copied_into(par_state, r) for r in (1, 2)]

    par, ref, first = both(w.state, w.state, "step 1")
    plan = parallel.plan
    assert plan.num_replicas == 3 and len(set(plan.replica_batch)) > 1
    assert all(n > 0 for n in first)  # the first step copies the arguments into every replica
    kept = next(iter(parallel._kept.values()))
    for r in (1, 2):
        stage = plan.replica_stages(r)[0].index
        pairs = [(x, kept.copy_of(x, stage)) for x in jax.tree.leaves(par) if kept.copy_of(x, stage) is not None]
        assert len(pairs) >= len(jax.tree.leaves(par.params))  # parameters and moments, each beside replica 0's
        assert all(x.devices() != y.devices() and np.array_equal(x, y) for x, y in pairs)  # bit for bit replica 0's
    par, ref, second = both(par, ref, "step 2")
    assert second == [0, 0]  # every replica reads its own copy: nothing of the returned state crosses
    changed = lambda s: s.replace(params=jax.tree.map(lambda p: p * 0.5, s.params))  # noqa: E731
    par, ref, third = both(changed(par), changed(ref), "step 3 from changed parameters")
    n = len(jax.tree.leaves(par.params))
    assert third[0] >= n and third[1] >= n  # the caller's new parameters are copied, not the replicas' stale ones
    both(par, ref, "step 4")


def _replicas_problem():
    """Eight equal layers on three kinds of one 4-device node each (one NIC a node),
    every pair of kinds joined at 1e10 bytes/s that a node's flows share."""
    from solver.collectives import LinkCost
    from solver.cost.problem import DeviceKind, LayerCost, Problem
    layers = tuple(LayerCost(flops=1e12, forward_flops=1e12 / 3, param_bytes=2**26, saved_bytes=2**20, input_bytes=2**18)
                   for _ in range(8))
    kinds = tuple(DeviceKind(name, 4, 4, flops, 16 * 2**30, 1e12, LinkCost(1e11, 5e-6), LinkCost(1e10, 1e-5, shared=1e10))
                  for name, flops in (("fast", 8e12), ("slow", 2e12), ("third", 2e12)))
    between = LinkCost(1e10, 1e-5, shared=1e10)
    return Problem(layers, kinds, batch_size=32, links=(("fast", "slow", between), ("fast", "third", between),
                                                         ("slow", "third", between)))


def test_three_replicas_are_priced_with_two_whole_shares_into_each():
    """What runs is what is priced: every replica sums all replicas' shares itself, so
    with three replicas each replica's devices receive the two others' whole shares
    (k - 1 = 2; a ring all-reduce would price 2 (k - 1) / k = 4/3 of one). Each of the
    4 streams (a device of the smallest replica) carries 1/4 of the gradients over the
    between-kinds link its node's 4 flows share (1e10 / 4 each). Two replicas: the
    all-reduce of one share, as before."""
    from solver.cost.collectives_used import collectives_used
    from solver.cost.decisions import Decisions, StageDecision
    from solver.cost.estimate import estimate
    from solver.cost.stage_costs import StageCosts
    problem = _replicas_problem()
    costs = StageCosts(problem)
    share, per_flow, latency = float(costs.params.sum()) / 4, 1e10 / 4, 1e-5

    def replicas(kinds, batch):
        return Decisions(tuple(StageDecision(k, 4, 1, 0, 8, replica=r) for r, k in enumerate(kinds)), 4, "1f1b", batch)
    three = replicas(("fast", "slow", "third"), (16, 8, 8))
    cost = estimate(problem, three, costs)
    assert cost.cross_sync_s == pytest.approx(2 * (latency + share / per_flow), rel=1e-9)
    assert cost.cross_sync_s > 1.4 * (4 * latency + 4 / 3 * share / per_flow)  # half again the ring's price
    assert all(c.sync_s >= cost.cross_sync_s for c in cost.stages)  # every replica's stages wait for it
    used = [u for u in collectives_used(problem, three, costs) if u.stage is None]
    assert [(u.collective, u.nbytes) for u in used] == [("all_gather", pytest.approx(3 * share))]
    two = estimate(problem, replicas(("fast", "slow"), (24, 8)), costs)
    assert two.cross_sync_s == pytest.approx(latency + share / per_flow, rel=1e-9)  # one share each way

"""Mixed-kind stages (issue 30, item 3): one pipeline stage's data-parallel parts on
devices of different kinds, each taking its rows of every microbatch, gradients
summed across them. Parity with jax.jit, the estimator's price, the plan file."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import hetpar
from hetpar.errors import PlanError
from hetpar.plan.costs import estimate_plan
from hetpar.plan.file import load_plan, save_plan
from hetpar.plan.mixed import Part, mix_stage, proportional_examples
from models import mlp
from parity import run_parity, with_grads
from solver.collectives import LinkCost
from solver.cost.estimate import estimate
from solver.cost.problem import DeviceKind, LayerCost, Problem
from solver.cost.stage_costs import StageConfig, StageCosts
from solver.planner import Planner
from solver.planner import mixed as planner_mixed
from solver.planner.step import decisions, with_costs

THREE_KINDS = {"A100": 2, "V100": 2, "T4": 2}
FOUR_KINDS = {"H100": 2, "A100": 2, "V100": 2, "T4": 2}


def _mlp(batch: int = 10):
    return mlp.setup(batch_size=batch, hidden=32, depth=3)


def _plan(workload, counts: dict, **options) -> tuple[hetpar.Cluster, hetpar.Plan]:
    cluster = hetpar.Cluster.virtual(counts)
    options = {k: v for k, v in {"num_stages": 2, "num_layers": 4, "num_microbatches": 2, **options}.items() if v is not None}
    return cluster, hetpar.make_plan(with_grads(workload.loss_fn), (workload.state, workload.batch), cluster, **options)


def _positions(plan: hetpar.Plan, group: str) -> tuple[int, ...]:
    """The device positions of cluster group `group` (groups lie in order)."""
    start = 0
    for g in plan.cluster_groups:
        if g.name == group:
            return tuple(range(start, start + g.devices))
        start += g.devices
    raise KeyError(group)


def _last_stage_mixed(plan: hetpar.Plan, shares=(3, 2)) -> hetpar.Plan:
    """The last stage (on V100s) split 3 + 2 rows of each 5-example microbatch with the idle T4s."""
    last = plan.stages[-1]
    return mix_stage(plan, last.index, [Part(last.group, last.device_ids, shares[0]), Part("T4", _positions(plan, "T4"), shares[1])])


def test_two_kind_mixed_stage_parity_with_an_uneven_split():
    """Stage 1 on 2 V100 + 2 T4: each 5-example microbatch splits 3 + 2 (not even),
    the A100 stage's activations cut by rows, the cotangents joined back."""
    w = _mlp()
    cluster, plan = _plan(w, THREE_KINDS)
    mixed = _last_stage_mixed(plan)
    assert [(s.device_type, s.examples, s.part_of) for s in mixed.stages] == [("A100", 0, -1), ("V100", 3, -1), ("T4", 2, 1)]
    used = run_parity(w, cluster, steps=3, plan=mixed)  # steps 2 and 3 read the parts' own updated state
    assert used.mixed_stages == (1,)


def test_three_kind_mixed_first_stage_parity():
    """The first stage split over three kinds (3 + 2 + 2 rows of 7): the batch is cut
    straight into each part's rows and the parts' outputs joined for the next stage."""
    w = _mlp(batch=14)
    cluster, plan = _plan(w, FOUR_KINDS)
    first = plan.stages[0]
    assert first.device_type == "H100"
    mixed = mix_stage(plan, 0, [Part(first.group, first.device_ids, 3), Part("V100", _positions(plan, "V100"), 2),
                                Part("T4", _positions(plan, "T4"), 2)])
    assert sorted(s.device_type for s in mixed.parts(0)) == ["H100", "T4", "V100"]
    run_parity(w, cluster, steps=3, plan=mixed)


class _Moves:
    """The device path with every move recorded (source, target sharding)."""

    def __init__(self, path):
        self.path, self.seen = path, []

    def to_mesh(self, x, sharding):
        self.seen.append((x, sharding))
        return self.path.to_mesh(x, sharding)

    def __getattr__(self, name):
        return getattr(self.path, name)


def test_each_part_updates_its_own_state_and_a_next_step_copies_none_of_it(monkeypatch):
    """Every part runs the update on its own copy: the next step reads the T4 part's
    parameters and optimizer state where its own update left them (no move of any
    state the lead returned onto the T4s). State the caller changed (new arrays) is
    copied from the arguments, and the steps stay in parity."""
    import jax

    from hetpar.runtime import executor
    from parity import assert_close
    w = _mlp()
    cluster, plan = _plan(w, THREE_KINDS)
    mixed = _last_stage_mixed(plan)
    step = with_grads(w.loss_fn)
    parallel, reference = hetpar.parallelize(step, cluster=cluster, plan=mixed), jax.jit(step)
    moves = _Moves(executor._PATH)
    monkeypatch.setattr(executor, "_PATH", moves)

    def copied_into_t4(state) -> int:
        """Moves of `state`'s own parameters and moments (the call's arguments; not the
        scalar step count, which another stage updates and every update reads) onto
        the T4 part's devices."""
        compiled = parallel.compiled()
        t4 = {d for p in compiled.programs if p.task.stage == 2 for d in p.mesh.devices.flat}
        mine = {id(x) for x in jax.tree.leaves(state) if np.ndim(x)}
        return sum(1 for x, target in moves.seen if id(x) in mine and set(target.device_set) <= t4)

    def both(par_state, ref_state, what):
        moves.seen.clear()
        par, ref = parallel(par_state, w.batch), reference(ref_state, w.batch)
        for a, e, name in zip(par, ref, ("state", "loss", "gradients")):
            assert_close(a, e, f"{name}, {what}")
        return par[0], ref[0], copied_into_t4(par_state)

    par, ref, _ = both(w.state, w.state, "step 1")  # the T4 part's state copied from the arguments
    kept = next(iter(parallel._kept.values()))  # the runtime's part copies, by the lead's returned arrays
    pairs = [(x, kept.copy_of(x, 2)) for x in jax.tree.leaves(par.params) if kept.copy_of(x, 2) is not None]
    assert len(pairs) == 2  # the last layer's weight and bias, each beside the lead's on the T4s
    assert all(x.devices() != y.devices() and np.array_equal(x, y) for x, y in pairs)
    par, ref, second = both(par, ref, "step 2")
    assert second == 0  # every part's own copy: nothing of the returned state crosses to the T4s
    changed = lambda s: s.replace(params=jax.tree.map(lambda p: p * 0.5, s.params))  # noqa: E731
    par, ref, third = both(changed(par), changed(ref), "step 3 from changed parameters")
    assert third == 2  # the caller's new parameters (the last layer's two) are copied, not the part's stale ones
    both(par, ref, "step 4")


def test_mixed_single_stage_with_one_microbatch_parity():
    """One stage, one microbatch of 7 examples split 4 + 3 over A100 and T4 meshes of
    different sizes (2 and 1 devices): the whole step is the parts' sum."""
    w = _mlp(batch=7)
    cluster, plan = _plan(w, {"A100": 2, "T4": 1}, num_stages=1, num_microbatches=1)
    s = plan.stages[0]
    mixed = mix_stage(plan, 0, [Part(s.group, s.device_ids, 4), Part("T4", _positions(plan, "T4"), 3)])
    run_parity(w, cluster, steps=2, plan=mixed)


@pytest.mark.parametrize("replica, batch, microbatches", [(0, 16, 2), (1, 64, 1)])
def test_a_mixed_stage_inside_a_replica_plan_parity(replica, batch, microbatches):
    """Two data-parallel pipelines of uneven shares; one replica's stage split between its
    devices and the T4s (replica 0's 4 + 2 rows of each 6-example microbatch of 12, or
    replica 1's one microbatch about evenly): the parts' sums, then the replicas', on
    every part and replica, each updating its own copy."""
    w = _mlp(batch=batch)
    cluster, plan = _plan(w, THREE_KINDS, num_stages=None, num_replicas=2, num_microbatches=microbatches)
    b = plan.replica_batch[replica] // microbatches
    assert len(set(plan.replica_batch)) == 2 and (replica == 1 or plan.replica_batch == (12, 4)) and b >= 4
    shares = (4, 2) if replica == 0 else (b - b // 2, b // 2)
    s = plan.replica_stages(replica)[0]
    mixed = mix_stage(plan, s.index, [Part(s.group, s.device_ids, shares[0]), Part("T4", _positions(plan, "T4"), shares[1])])
    run_parity(w, cluster, steps=3, plan=mixed)  # steps 2 and 3: every part and replica on its own updated copy


def _alone(plan: hetpar.Plan, part: hetpar.StagePlan) -> tuple[float, float]:
    """A part priced as a stage of its own kind at its rows: (forward, own gradient sync)."""
    costs = StageCosts(plan.cost_inputs)
    v = costs.variant(StageConfig(part.group, part.data_parallel, part.tensor_parallel), part.examples, 1, True, 0, "")
    at = lambda x: float(np.broadcast_to(x, v.forward.shape)[part.layer_start, part.layer_end])  # noqa: E731
    return at(v.forward), at(v.sync)


def test_the_slowest_part_sets_the_stage_time_and_the_parts_sum_their_gradients():
    w = _mlp()
    _, plan = _plan(w, THREE_KINDS)
    even = _last_stage_mixed(plan, (3, 2))
    heavy = _last_stage_mixed(plan, (1, 4))  # the slow T4s take most rows
    for p in (even, heavy):
        lead, t4 = p.parts(1)
        (lead_fwd, lead_sync), (t4_fwd, t4_sync) = _alone(p, lead), _alone(p, t4)
        assert t4.forward_s == pytest.approx(t4_fwd)
        assert lead.forward_s == pytest.approx(max(lead_fwd, t4_fwd))  # the position runs at its slowest part's pace
        assert lead.sync_s > max(lead_sync, t4_sync)  # the parts' all-reduce is charged on top
        assert t4.memory_bytes > 0 and t4.memory_capacity > 0
    assert heavy.parts(1)[1].forward_s > even.parts(1)[1].forward_s  # more rows, more time on the T4s
    assert heavy.predicted_step_time_s > even.predicted_step_time_s
    cost = estimate_plan(even)
    assert cost.step_s == pytest.approx(even.predicted_step_time_s)
    assert len(cost.replica_times(0)) == 2  # two pipeline positions, not three


def test_plan_file_round_trip(tmp_path):
    w = _mlp()
    _, plan = _plan(w, THREE_KINDS)
    mixed = _last_stage_mixed(plan)
    path = tmp_path / "mixed.json"
    save_plan(mixed, path)
    loaded = load_plan(path)
    assert [(s.part_of, s.examples, s.device_ids) for s in loaded.stages] == [(s.part_of, s.examples, s.device_ids) for s in mixed.stages]
    assert loaded.predicted_step_time_s == pytest.approx(mixed.predicted_step_time_s)
    assert loaded.mixed_stages == (1,)


def test_shares_that_do_not_make_up_the_microbatch_are_refused(tmp_path):
    w = _mlp()
    _, plan = _plan(w, THREE_KINDS)
    with pytest.raises(PlanError, match="sum to 5"):
        _last_stage_mixed(plan, (3, 3))
    with pytest.raises(PlanError, match="at least one"):
        _last_stage_mixed(plan, (5, 0))
    mixed = _last_stage_mixed(plan)
    path = tmp_path / "bad.json"
    save_plan(replace(mixed, stages=tuple(replace(s, examples=4) if s.index == 2 else s for s in mixed.stages)), path)
    with pytest.raises(PlanError, match=r"take \[3, 4\] examples.*sum to 5"):
        load_plan(path)
    with pytest.raises(PlanError, match="cluster group 'P100'"):
        mix_stage(plan, 1, [Part("V100", plan.stages[1].device_ids, 3), Part("P100", (4,), 2)])
    with pytest.raises(PlanError, match="used by another stage"):
        mix_stage(plan, 1, [Part("V100", plan.stages[1].device_ids, 3), Part("T4", plan.stages[0].device_ids, 2)])


def test_proportional_examples():
    assert proportional_examples(5, [2.0, 1.0]) == (3, 2)
    assert proportional_examples(8, [3.0, 1.0]) == (6, 2)
    assert proportional_examples(3, [100.0, 1.0, 1.0]) == (1, 1, 1)
    assert sum(proportional_examples(17, [5.0, 3.0, 1.5])) == 17
    assert proportional_examples(6, [100.0, 1.0, 1.0], least=2) == (2, 2, 2)
    with pytest.raises(PlanError, match=r"at least \[1, 1, 1\]"):
        proportional_examples(2, [1.0, 1.0, 1.0])


def _synthetic(link_bandwidth: float) -> Problem:
    """Four equal layers; 4 fast devices, 2 slow and 2 slower ones, no replicas: the
    search's best is one stage on the fast kind, the others idle."""
    layers = tuple(LayerCost(flops=1e12, forward_flops=1e12 / 3, param_bytes=2**22, saved_bytes=2**20, input_bytes=2**18)
                   for _ in range(4))
    kind = lambda name, n, flops: DeviceKind(name, n, n, flops, 16 * 2**30, 1e12, LinkCost(1e11, 5e-6), LinkCost(1e10, 1e-5))  # noqa: E731
    kinds = (kind("fast", 4, 8e12), kind("slow", 2, 2e12), kind("slower", 2, 1e12))
    links = tuple((a.name, b.name, LinkCost(link_bandwidth, 2e-5)) for i, a in enumerate(kinds) for b in kinds[i + 1:])
    return Problem(layers, kinds, batch_size=32, links=links, allow_replicas=False, schedules=("1f1b", "gpipe"))


def test_the_planner_chooses_a_mixed_stage_where_the_estimator_says_it_wins(monkeypatch):
    """Idle slow devices joined to the fast stage as a part: chosen over a fast link
    (the estimator prices it faster than the search's best), not over a slow one."""
    fast = Planner(_synthetic(2e10), top_k=1).solve().best
    slow = Planner(_synthetic(1e5), top_k=1).solve().best
    monkeypatch.setattr(planner_mixed, "MIXED_FINALISTS", 0)
    plain = Planner(_synthetic(2e10), top_k=1).solve().best
    assert not plain.mixed and fast.mixed and not slow.mixed
    assert fast.step_s < plain.step_s and slow.step_s == pytest.approx(plain.step_s)
    lead, *others = fast.parts(0)
    assert lead.kind == "fast" and {o.kind for o in others} <= {"slow", "slower"}
    assert sum(s.examples for s in fast.parts(0)) == 32 // fast.num_microbatches
    assert fast.step_s == pytest.approx(estimate(_synthetic(2e10), decisions(fast)).step_s)  # the one estimator's price


def _force_t4_part(monkeypatch, t4_zero: int, lead_zero: int | None = None) -> None:
    """The search's widening forced to mix the last stage of the first one-pipeline,
    one-chunk finalist without T4s with the idle T4s (at ZeRO `t4_zero`; the lead at
    `lead_zero` where given), so the planner's mixed choice is tested through the whole
    pipeline whichever plan would win."""
    from solver.planner import search as planner_search

    def forced(problem, found, costs, read=None):
        best = next((c for c in found if len(c.replica_batch) == 1 and c.chunks == 1 and "T4" not in {s.kind for s in c.stages}), None)
        if best is None:  # the idle-kinds note's search, every kind in use
            return found
        last = len(best.stages) - 1
        if lead_zero is not None:
            best = replace(best, stages=tuple(replace(s, zero=lead_zero) if i == last else s for i, s in enumerate(best.stages)))
        t4 = next(k for k in problem.kinds if k.name == "T4")
        b = best.replica_batch[0] // best.num_microbatches
        mixed = planner_mixed._mixed(best, last, [(StageConfig("T4", t4.count, 1), t4_zero, 1.0)], b, costs)
        return [with_costs(mixed, estimate(problem, decisions(mixed), costs))]

    monkeypatch.setattr(planner_search, "with_mixed_stages", forced)


def test_a_planned_mixed_stage_becomes_a_plan_that_runs(monkeypatch):
    """The planner's mixed choice through the whole pipeline (to_plan: the parts on
    the idle devices; sharding, placement, operator stages), with parity: the search's
    widening is forced to mix the last stage with the idle T4s."""
    _force_t4_part(monkeypatch, t4_zero=0)
    w = _mlp()
    cluster, plan = _plan(w, THREE_KINDS, num_stages=None)  # the planner's choice
    assert len(plan.mixed_stages) == 1
    t4 = plan.parts(plan.mixed_stages[0])[1]
    assert t4.device_type == "T4" and t4.device_ids == _positions(plan, "T4") and t4.examples >= 2
    run_parity(w, cluster, steps=2, plan=plan)


def _two_kinds(overlap: bool = False, slow_memory: float = 1e12, between: float = 1e10, nodes_link: float = 1e10) -> Problem:
    """Eight equal layers on a node of 4 fast devices and a node of 4 slow ones (their
    memory `slow_memory` bytes/s), `between` bytes/s between the kinds."""
    layers = tuple(LayerCost(flops=1e12, forward_flops=1e12 / 3, param_bytes=2**26, saved_bytes=2**20, input_bytes=2**18)
                   for _ in range(8))
    # the fast node has four NICs, the slow one one: their flows share 4x and 1x `nodes_link`
    fast = DeviceKind("fast", 4, 4, 8e12, 16 * 2**30, 1e12, LinkCost(1e11, 5e-6), LinkCost(nodes_link, 1e-5, shared=4 * nodes_link))
    slow = DeviceKind("slow", 4, 4, 2e12, 16 * 2**30, slow_memory, LinkCost(1e11, 5e-6), LinkCost(nodes_link, 1e-5, shared=nodes_link))
    return Problem(layers, (fast, slow), batch_size=32, links=(("fast", "slow", LinkCost(between, 1e-5, shared=between)),),
                   allow_replicas=False, overlap_comm=overlap)


def _one_mixed_stage(rows=(6, 2), zero=0):
    from solver.cost.decisions import Decisions, StageDecision
    return Decisions((StageDecision("fast", 4, 1, 0, 8, zero=zero, examples=rows[0]),
                      StageDecision("slow", 4, 1, 0, 8, zero=zero, part_of=0, examples=rows[1])), 4, "1f1b", (32,))


def test_every_part_holds_its_optimizer_state_and_updates_beside_the_others():
    """As the runtime runs it: every part ends the sum with the same total and updates
    its own copy, so each part's memory holds the optimizer state, the position's
    update is its slowest part's (a part on slow memory slows it), nothing crosses
    between the kinds for the next step (the update is the same over a slower link
    between them), and a shared host's serial step charges every part's update."""
    from solver.cost.decisions import Decisions, StageDecision
    from solver.cost.estimate import serial_step_s
    alone = lambda kind: Decisions((StageDecision(kind, 4, 1, 0, 8),), 4, "1f1b", (32,))  # noqa: E731
    for slow_memory in (1e12, 1e10):
        problem = _two_kinds(slow_memory=slow_memory)
        lead, part = estimate(problem, _one_mixed_stage()).stages
        assert part.memory.optimizer_state == pytest.approx(lead.memory.optimizer_state) and part.memory.optimizer_state > 0
        fast, slow = (estimate(problem, alone(k)).stages[0].optimizer_s for k in ("fast", "slow"))
        assert part.optimizer_s == pytest.approx(slow) and slow > 0
        assert lead.optimizer_s == pytest.approx(max(fast, slow))  # the position: the slowest part's update
    assert estimate(_two_kinds(slow_memory=1e10), _one_mixed_stage()).stages[0].optimizer_s > \
        estimate(_two_kinds(slow_memory=1e12), _one_mixed_stage()).stages[0].optimizer_s
    near, far = (estimate(_two_kinds(between=b), _one_mixed_stage()).stages[0].optimizer_s for b in (1e10, 1e9))
    assert far == pytest.approx(near)  # no parameter copy between the kinds
    shared = _two_kinds()
    shared = replace(shared, kinds=tuple(replace(k, shared_host=True) for k in shared.kinds))
    cost = estimate(shared, _one_mixed_stage())
    lead, part = cost.stages
    assert cost.step_s == pytest.approx(serial_step_s(cost.stages, 4, 0.0))
    assert cost.step_s - serial_step_s((lead, replace(part, optimizer_s=0.0)), 4, 0.0) == pytest.approx(part.optimizer_s)


def test_the_sum_between_kinds_is_priced_as_the_same_devices_one_kind_stage_would_be():
    """One all-reduce over both parts' devices (a flat ring over the two nodes, the
    registry's pick) where it beats each part's own sum followed by the sum between
    kinds; never more than that hierarchical pair; and overlapped under the backward
    where the problem overlaps data-parallel collectives, as a stage's own is."""
    from solver.collectives import best
    from solver.cost.mixed import joined_topology, parts_sync_s
    problem = _two_kinds()
    d = _one_mixed_stage()
    costs = StageCosts(problem)
    cost = estimate(problem, d, costs)
    lead, part = cost.stages
    own = max(_own_sync(costs, s) for s in d.stages)
    pair = own + parts_sync_s(costs, list(d.stages))
    whole = best("all_reduce", joined_topology(costs, list(d.stages)), float(costs.params.sum()))[1]
    assert lead.sync_s == pytest.approx(min(pair, whole))
    assert lead.sync_s <= pair
    # a same-kind stage over the two nodes, the between link (the slow node's one NIC) as its nodes': the same price
    same = replace(problem.kind("fast"), count=8, inter=problem.link("fast", "slow"))
    one_kind = Problem(problem.layers, (same,), batch_size=32, allow_replicas=False)
    from solver.cost.decisions import Decisions, StageDecision
    alone = estimate(one_kind, Decisions((StageDecision("fast", 8, 1, 0, 8),), 4, "1f1b", (32,)))
    assert lead.sync_s == pytest.approx(alone.stages[0].sync_s, rel=1e-6)
    # overlapped: part of the sum between kinds runs under the last backward
    overlapped = estimate(_two_kinds(overlap=True), d)
    ov_lead = overlapped.stages[0]
    assert ov_lead.overlapped_s > max(s.overlapped_s for s in overlapped.stages[1:])
    assert ov_lead.sync_s < pair


def _three_kinds(overlap: bool = False) -> Problem:
    """`_two_kinds` and a third kind, "third", as fast as "slow", one NIC per node, every
    pair of kinds joined at 1e10 bytes/s (a node's flows sharing it)."""
    two = _two_kinds(overlap=overlap)
    slow = two.kind("slow")
    third = replace(slow, name="third")
    between = LinkCost(1e10, 1e-5, shared=1e10)
    return replace(two, kinds=(*two.kinds, third), links=(*two.links, ("fast", "third", between), ("slow", "third", between)))


def _mixed(kinds_rows: tuple[tuple[str, int], ...]):
    """One mixed stage over all eight layers, a 4-device part per (kind, rows)."""
    from solver.cost.decisions import Decisions, StageDecision
    (lead, rows), *rest = kinds_rows
    return Decisions((StageDecision(lead, 4, 1, 0, 8, examples=rows),
                      *(StageDecision(k, 4, 1, 0, 8, part_of=0, examples=r) for k, r in rest)), 4, "1f1b", (32,))


def test_three_parts_each_receive_the_two_others_whole_shares():
    """The runtime sums a mixed stage's parts' gradients on every part, each adding all
    shares (hetpar/runtime/sums.py): with three parts each part's devices receive two
    whole shares, k - 1 = 2 (a ring all-reduce would price 2 (k - 1) / k = 4/3 of one).
    Each of the 4 streams (one per device of a part) carries its 1/4 of the layers'
    gradients over the between-kinds link, which the node's 4 flows share (1e10 / 4).
    Two parts keep the all-reduce of one share (each whole share to the other)."""
    from solver.cost.collectives_used import collectives_used
    from solver.cost.mixed import parts_sync_s
    problem = _three_kinds()
    costs = StageCosts(problem)
    share = float(costs.params.sum()) / 4  # each stream's share of the stage's gradients
    per_flow, latency = 1e10 / 4, 1e-5
    d3 = _mixed((("fast", 4), ("slow", 2), ("third", 2)))
    lead = estimate(problem, d3, costs).stages[0]
    own = max(_own_sync(costs, s) for s in d3.stages)
    gathered = 2 * (latency + share / per_flow)  # two whole shares in, a latency each
    assert parts_sync_s(costs, list(d3.stages)) == pytest.approx(gathered, rel=1e-9)
    assert lead.sync_s == pytest.approx(own + gathered, rel=1e-9)
    ring = 2 * 2 * latency + 4 / 3 * share / per_flow
    assert lead.sync_s - own > 1.4 * ring  # half again what the ring all-reduce priced
    used = [u for u in collectives_used(problem, d3, costs) if u.purpose.startswith("gradients across a mixed")]
    assert [(u.collective, u.nbytes) for u in used] == [("all_gather", pytest.approx(3 * share))]
    # overlapped: the buckets (one per layer) add up to the same two shares per stream
    ov = estimate(_three_kinds(overlap=True), d3)
    ov_lead, ov_parts = ov.stages[0], ov.stages[1:]
    assert ov_lead.overlapped_s > 0  # some of it hidden under the last backward
    ov_own = max(p.sync_s + p.overlapped_s for p in ov_parts)  # the other parts' own sums
    assert ov_lead.sync_s + ov_lead.overlapped_s - ov_own >= 2 * share / per_flow
    # two parts: the all-reduce of one share (the registry's pick over two: one exchange of it)
    d2 = _mixed((("fast", 6), ("slow", 2)))
    assert parts_sync_s(costs, list(d2.stages)) == pytest.approx(latency + share / per_flow, rel=1e-9)
    used = [u for u in collectives_used(problem, d2, costs) if u.purpose.startswith("gradients across a mixed")]
    assert [(u.collective, u.nbytes) for u in used] == [("all_reduce", pytest.approx(share))]


def _own_sync(costs: StageCosts, s) -> float:
    v = costs.variant(s.config, s.examples, 1, False, s.zero, "")
    return float(np.broadcast_to(v.sync, v.forward.shape)[s.layer_start, s.layer_end])


def test_a_merged_stage_takes_the_layers_its_speed_earns():
    """Two adjacent stages of different kinds made one mixed stage, the layers split
    again around it (`_resplit`): no position busier than under the split it came
    with, every layer held once, the parts on their lead's layers, and the estimator
    prices the result at no less than the floor `_resplit` gives."""
    problem = _two_kinds(between=1e11, nodes_link=1e11)
    costs = StageCosts(problem)
    plain = Planner(problem, top_k=1).solve().best
    assert not plain.mixed and len(plain.stages) >= 2
    base = replace(plain, num_microbatches=2)
    fast = next(p for p, s in enumerate(base.stages[:-1]) if s.kind != base.stages[p + 1].kind)
    meshes = planner_mixed._merged_meshes(problem, base, fast, 16)
    assert meshes
    merged = planner_mixed._merged(problem, base, fast, costs, meshes[0])
    split, floor, _ = planner_mixed._resplit(problem, merged, costs)
    cost = estimate(problem, decisions(split), costs)
    assert cost.fits and 0 < floor <= cost.step_s
    leads = [i for i, s in enumerate(split.stages) if s.part_of < 0]
    assert [(split.stages[i].layer_start, split.stages[i].layer_end) for i in leads][0][0] == 0
    assert all(split.stages[i].layer_end == split.stages[j].layer_start for i, j in zip(leads, leads[1:]))
    assert split.stages[leads[-1]].layer_end == len(problem.layers)
    lead, *parts = split.parts(fast)
    assert parts and all((q.layer_start, q.layer_end) == (lead.layer_start, lead.layer_end) for q in parts)

    def busiest(choice):
        n = len(leads)
        tables = [planner_mixed._position(problem, costs, tuple(s for k, s in enumerate(choice.stages) if k == i or s.part_of == i),
                                          16, 2, planner_mixed.in_flight(choice.schedule, 2, p, n), p == n - 1)
                  for p, i in enumerate(leads)]
        return max(t["cost"][choice.stages[i].layer_start, choice.stages[i].layer_end] for t, i in zip(tables, leads))
    assert busiest(split) <= busiest(merged)


@pytest.mark.parametrize("zero", [1, 3])
def test_mixed_stage_parts_under_zero_parity(zero):
    """A mixed stage whose parts shard over their own data axes (ZeRO-1: optimizer
    state; ZeRO-3: parameters too, gathered a layer at a time), as a T4 part must to
    hold a stage's state: the runtime runs it with parity."""
    from hetpar.options import ShardingOption, StageOption
    w = _mlp()
    cluster, plan = _plan(w, THREE_KINDS, sharding_option=ShardingOption(zero=zero), stage_option=StageOption(mode="uniform"))
    mixed = _last_stage_mixed(plan)
    lead, t4 = mixed.parts(mixed.mixed_stages[0])
    assert t4.device_type == "T4" and t4.zero == zero and any("data" in spec for _, spec in t4.shardings)
    assert bool(t4.gathered) == (zero == 3)
    run_parity(w, cluster, steps=2, plan=mixed)


def test_a_planned_part_with_its_own_zero_stage_runs(monkeypatch):
    """The planner gives a part its own ZeRO stage (the least that fits it, whatever
    its lead's): a T4 part at ZeRO-2 beside a lead without, through to_plan and the
    sharding pass, with parity."""
    _force_t4_part(monkeypatch, t4_zero=2, lead_zero=0)
    w = _mlp()
    cluster, plan = _plan(w, THREE_KINDS, num_stages=None)
    lead, t4 = plan.parts(plan.mixed_stages[0])
    assert t4.device_type == "T4" and t4.zero == 2 and lead.zero == 0
    assert any("data" in spec for _, spec in t4.shardings)
    run_parity(w, cluster, steps=2, plan=plan)


def test_the_widened_finalists_are_the_fastest_of_each_shape():
    """The finalists widened with mixed stages: the fastest pipeline of each order of
    kinds, in rank order (later ones of a shape differ in meshes and microbatches,
    which the variants choose again)."""
    def choice(kinds, step):
        stages = tuple(planner_mixed.StageChoice(k, 1, 1, i, i + 1, False, 0, 0, 0, 0, 0, 0, 1) for i, k in enumerate(kinds))
        return planner_mixed.PlanChoice(stages, 1, "1f1b", step, (8,))
    ranked = [choice("ab", 1.0), choice("ab", 1.1), choice("ba", 1.2), choice("a", 1.3), choice("ba", 1.4)]
    assert [c.step_s for c in planner_mixed._shapes(ranked)] == [1.0, 1.2, 1.3]


def test_a_planned_part_takes_at_least_the_least_microbatch():
    """A part's rows are traced as a microbatch is, so the planner gives none fewer
    than the problem's least microbatch (a size-1 part of a traced step would trace
    apart), however slow it is."""
    problem = replace(_two_kinds(), min_microbatch=2)
    costs = StageCosts(problem)
    plain = replace(Planner(replace(problem, allow_mixed=False), top_k=1).solve().best, num_microbatches=2)
    b = 16
    for least in (1, 2):
        p = replace(problem, min_microbatch=least)
        slow = planner_mixed._mixed(plain, 0, [(StageConfig("slow", 1, 1), 0, 1e-9)], b, StageCosts(p))
        assert slow is not None and slow.parts(0)[1].examples == least


def test_the_planners_part_tables_charge_every_part_its_optimizer_state_and_update():
    """The widening's tables price a part as the estimator does: its own update in its
    tail and the optimizer state in its memory, so a slow kind whose memory holds the
    layers' parameters, gradients and activations but not their optimizer state cannot
    be a part (it must update its own copy), and the planner's floor stays under the
    estimator's."""
    problem = replace(_two_kinds(), zero_stages=(0,))  # the state whole on every device
    costs = StageCosts(problem)
    cfg = StageConfig("slow", 4, 1)
    v = costs.variant(cfg, 2, 1, True, 0, "")
    whole = float(np.broadcast_to(v.memory.total, (9, 9))[0, 8])
    held = whole - float(np.broadcast_to(v.memory.optimizer_state, (9, 9))[0, 8])
    slow = next(k for k in problem.kinds if k.name == "slow")
    capacity = (held + whole) / 2  # between the two
    memory = (capacity / (1 - problem.memory_reserve) + slow.process_reserve_bytes) / slow.memory_fraction
    tight = replace(problem, kinds=tuple(replace(k, memory_bytes=int(memory)) if k is slow else k for k in problem.kinds))
    part = planner_mixed._part(StageCosts(tight), cfg, 2, 4, 1, True, "")
    assert not np.isfinite(part[0][0, 8])
    roomy = planner_mixed._part(costs, cfg, 2, 4, 1, True, "")
    assert np.isfinite(roomy[0][0, 8])
    assert roomy[2][0, 8] == pytest.approx(float(np.broadcast_to(v.tail, (9, 9))[0, 8])) and roomy[2][0, 8] > 0

"""Measured layer profiles (`hetpar profile --layers`): the JSON round trip and merge,
interpolation between microbatch sizes, a layer priced from its measurement beside
one priced from the model, and `show` saying which is which. Correctness only: no
test here depends on how fast anything runs."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetpar
from hetpar.cli import main
from hetpar.errors import HetparError
from hetpar.pipeline import layers_of
from hetpar.plan.file import load_plan, save_plan
from hetpar.predict.layer_profile import LayerPointRecord, LayerRecord, LayerTiming, _Layer, layer_signatures, layer_timing
from hetpar.predict.profile import Profile
from hetpar.trace.traced_step import trace_step
from models import gpt
from solver.collectives import LinkCost
from solver.cost.estimate import ESTIMATOR_VERSION, Decisions, StageDecision, estimate
from solver.cost.measured import LayerPoint, MeasuredLayer, interpolate, lookup
from solver.cost.problem import DeviceKind, LayerCost, Problem
from solver.cost.stage_costs import StageConfig, StageCosts

LINK = LinkCost(1e10, 1e-6)


def _record(kind: str = "A100", signature: str = "abc", dp: int = 1, scale: float = 1.0) -> LayerRecord:
    points = [LayerPointRecord(e, 1e-3 * e * scale, 2e-3 * e * scale, 3e-3 * e * scale, 5e-4, 1000 * e) for e in (1, 2, 4)]
    return LayerRecord(signature, "Block_0", kind, "float32", 1, dp, False, points)


def test_profile_json_round_trip_keeps_layer_records(tmp_path):
    profile = Profile({}, layers=[_record(), _record(dp=2, scale=0.6)])
    profile.save(tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["version"] == 3 and raw["layers"][0]["signature"] == "abc" and raw["layers"][1]["dp"] == 2
    back = Profile.load(tmp_path / "p.json")
    assert back.layers == profile.layers and back.jax_version == raw["jax_version"] == jax.__version__


def test_the_runtimes_host_costs_are_saved_and_loaded_with_the_records(tmp_path):
    record = replace(_record(), dispatch_s=2e-4, points=[replace(p, split_s=7e-4 * p.examples) for p in _record().points])
    Profile({}, layers=[record]).save(tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())["layers"][0]
    assert raw["dispatch_s"] == 2e-4 and [p["split_s"] for p in raw["points"]] == [7e-4, 14e-4, 28e-4]
    back = Profile.load(tmp_path / "p.json").layers[0]
    assert back == record
    # A profile made before these were measured loads with them unmeasured (0), and prices as before.
    for r in raw, *raw["points"]:
        r.pop("dispatch_s", None), r.pop("split_s", None)
    old = LayerRecord.from_dict(raw)
    assert old.dispatch_s == 0.0 and all(p.split_s == 0.0 for p in old.points)


def test_a_version_1_profile_still_loads(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"version": 1, "devices": {}}))
    assert Profile.load(tmp_path / "old.json").layers == []


def test_a_version_2_profiles_layer_records_are_refused_with_what_to_do(tmp_path):
    """Version 2 keyed layers by signatures in program order: none would match now, so
    a file with layer records is refused (profile again); one without still loads."""
    (tmp_path / "devices.json").write_text(json.dumps({"version": 2, "devices": {}, "layers": []}))
    assert Profile.load(tmp_path / "devices.json").jax_version == ""
    raw = json.loads(json.dumps(asdict(Profile({}, layers=[_record()]))))
    (tmp_path / "layers.json").write_text(json.dumps({**raw, "version": 2}))
    with pytest.raises(HetparError, match="version 2.*program order.*profile --layers again"):
        Profile.load(tmp_path / "layers.json")


def test_a_layers_signature_is_its_operators_whatever_their_order():
    """JAX 0.11.2 and 0.12 trace a Llama block's backward with two gradient sums in
    another order; the signature is the same for both, and still tells apart layers
    whose operators or types differ."""
    avals = [jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)]

    def signature(ops: list[tuple[str, int]]) -> str:
        graph = SimpleNamespace(ops=[SimpleNamespace(name=n, inputs=[v, v], outputs=[v]) for n, v in ops], avals=avals)
        layers = SimpleNamespace(num_layers=1, op_layer={i: 0 for i in range(len(ops))})
        return layer_signatures(graph, SimpleNamespace(batch_axis={0: 0, 1: 0}), layers)[0]

    block = [("mul", 0), ("add_any", 0), ("add_any", 1), ("exp", 0)]
    assert signature(block) == signature([block[0], block[2], block[3], block[1]])
    assert signature(block) != signature([*block[:3], ("exp", 1)])  # another type
    assert signature(block) != signature([*block[:3], ("log", 0)])  # another operator
    assert signature(block) != signature(block[:3])  # one operator fewer


def test_profiles_of_several_machines_merge_one_per_kind(tmp_path):
    Profile({}, layers=[_record("A100")]).save(tmp_path / "a.json")
    Profile({}, layers=[_record("V100", scale=3.0)]).save(tmp_path / "v.json")
    assert main(["profile", "--merge", str(tmp_path / "a.json"), str(tmp_path / "v.json"), "-o", str(tmp_path / "m.json")]) == 0
    merged = Profile.load(tmp_path / "m.json")
    assert sorted(r.device_kind for r in merged.layers) == ["A100", "V100"] and merged.jax_version == jax.__version__
    older = replace(Profile.load(tmp_path / "v.json"), jax_version="0.11.2")
    both = Profile.merge([("a", Profile.load(tmp_path / "a.json")), ("v", older)]).jax_version
    assert both == ", ".join(dict.fromkeys([jax.__version__, "0.11.2"]))
    with pytest.raises(HetparError, match="A100"):  # the same kind from two files: which to keep is the user's choice
        Profile.merge([("a.json", Profile.load(tmp_path / "a.json")), ("again.json", Profile.load(tmp_path / "a.json"))])


def test_interpolation_between_and_beyond_measured_sizes():
    xs, ys = np.array([1.0, 2.0, 4.0]), np.array([1.0, 3.0, 4.0])
    assert interpolate(xs, ys, 1.5) == pytest.approx(2.0)
    assert interpolate(xs, ys, 3.0) == pytest.approx(3.5)
    assert interpolate(xs, ys, 8.0) == pytest.approx(6.0)  # along the last segment
    assert interpolate(xs, ys, 0.0) == 0.0  # never below zero
    assert interpolate(np.array([2.0]), np.array([4.0]), 3.0) == pytest.approx(6.0)  # one point: proportional


def test_lookup_prefers_the_stages_own_data_parallel_degree():
    one = MeasuredLayer("k", 0, 1, 1, (LayerPoint(2, 1.0, 2.0, 3.0, 0.5),))
    four = MeasuredLayer("k", 0, 1, 4, (LayerPoint(2, 0.7, 1.4, -1.0, 0.9),))
    price = lookup((one, four), "k", 0, 1, 4, 2)
    assert (price.forward_s, price.backward_s, price.rerun_s, price.includes_sync) == (0.7, 1.4, None, True)
    price = lookup((one,), "k", 0, 1, 2, 2)  # another degree: one device's times, the reduction still to add
    assert (price.forward_s, price.rerun_s, price.includes_sync) == (1.0, 1.0, False)
    shared = replace(one, shared_host=True)  # a shared host: two devices' work on the same cores
    assert lookup((shared,), "k", 0, 1, 2, 2).forward_s == pytest.approx(2.0)
    assert lookup((one,), "k", 0, 2, 1, 2) is None  # no record for that tensor-parallel degree
    assert lookup((one,), "other", 0, 1, 1, 2) is None


def _problem(measured=()) -> Problem:
    layers = tuple(LayerCost(6e9, 2e9, 10**6, 1e5, 1e4, matmuls=4) for _ in range(3))
    kinds = (DeviceKind("A100", 4, 4, 1e14, 40 * 2**30, 1e12, LINK, LINK),)
    return Problem(layers, kinds, batch_size=8, measured_layers=tuple(measured))


def test_a_measured_layer_is_priced_from_its_profile_and_the_rest_from_the_model():
    measured = MeasuredLayer("A100", 1, 1, 2, (LayerPoint(1, 0.010, 0.030, 0.045, 0.002), LayerPoint(4, 0.040, 0.120, 0.18, 0.002)))
    model = StageCosts(_problem()).per_layer(StageConfig("A100", 2, 1), 4)
    priced = StageCosts(_problem([measured])).per_layer(StageConfig("A100", 2, 1), 4)  # 2 examples per device
    assert priced.forward[1] == pytest.approx(0.020) and priced.backward[1] == pytest.approx(0.060)
    assert priced.rerun[1] == pytest.approx(0.090 - 0.060)  # recomputation as measured
    for layer in (0, 2):
        assert priced.forward[layer] == model.forward[layer] and priced.backward[layer] == model.backward[layer]
    # The estimator's plan price follows: the measured layer is far slower than the roofline says.
    decisions = Decisions((StageDecision("A100", 2, 1, 0, 3),), 2, "1f1b", (8,))
    slow = estimate(_problem([measured]), decisions)
    assert slow.stages[0].forward_s == pytest.approx(model.forward[0] + 0.020 + model.forward[2])
    assert slow.step_s > estimate(_problem(), decisions).step_s


def test_a_shared_host_runs_its_stages_one_after_another():
    problem = _problem()
    shared = replace(problem, kinds=tuple(replace(k, shared_host=True) for k in problem.kinds))
    decisions = Decisions((StageDecision("A100", 2, 1, 0, 1), StageDecision("A100", 2, 1, 1, 3)), 4, "1f1b", (8,))
    cost = estimate(shared, decisions)
    # every microbatch's activation goes on and its gradient comes back: two sends a cut
    work = sum(4 * (c.forward_s + c.backward_s + 2 * c.send_s) + c.sync_s + c.optimizer_s for c in cost.stages)
    assert cost.stages[0].send_s > 0 and cost.step_s == pytest.approx(work)


def test_a_shared_hosts_sends_are_priced_as_the_profile_measured_them():
    # The host copies each activation (and its gradient back) shard by shard: the measured send of the
    # receiving layer's input at the stage's examples per device, not the link's bytes.
    points = (LayerPoint(1, 0.010, 0.020, -1.0, 0.0, send_s=0.001), LayerPoint(4, 0.030, 0.060, -1.0, 0.0, send_s=0.002))
    measured = tuple(MeasuredLayer("A100", layer, 1, 2, points, shared_host=True) for layer in range(3))
    problem = _problem(measured)
    shared = replace(problem, kinds=tuple(replace(k, shared_host=True) for k in problem.kinds))
    decisions = Decisions((StageDecision("A100", 2, 1, 0, 1), StageDecision("A100", 2, 1, 1, 3)), 2, "1f1b", (8,))
    cost = estimate(shared, decisions)  # 4 examples a microbatch, 2 per device: between the points
    assert cost.stages[0].send_s == pytest.approx(0.001 + (0.002 - 0.001) / 3) and cost.stages[1].send_s == 0.0
    work = sum(2 * (c.forward_s + c.backward_s + 2 * c.send_s) + c.sync_s + c.optimizer_s for c in cost.stages)
    assert cost.step_s == pytest.approx(work)
    unmeasured = replace(shared, measured_layers=tuple(replace(m, points=tuple(replace(p, send_s=0.0) for p in points))
                                                      for m in measured))
    assert estimate(unmeasured, decisions).stages[0].send_s < 1e-4  # the link's bytes: what the profile did not see
    one_way = replace(decisions, stages=(replace(decisions.stages[0], layer_end=2), replace(decisions.stages[1], layer_start=2)))
    assert estimate(shared, one_way).stages[0].send_s == pytest.approx(cost.stages[0].send_s)  # every block's input alike


def test_a_stage_program_costs_what_the_profile_measured_one_more_program_to_cost():
    # Layers measured one program each; a stage of two pays the measured per-program cost once per
    # program (forward, backward), not the near-empty program's launch once per layer.
    point = LayerPoint(2, 0.010, 0.020, -1.0, 0.0)
    measured = [replace(MeasuredLayer("A100", layer, 1, 2, (point,), program_s=0.001, stage_program_s=0.004))
                for layer in range(3)]
    decisions = Decisions((StageDecision("A100", 2, 1, 0, 2), StageDecision("A100", 2, 1, 2, 3)), 2, "1f1b", (8,))
    cost = estimate(_problem(measured), decisions)
    assert cost.stages[0].forward_s == pytest.approx(2 * (0.010 - 0.004) + 0.004)
    assert cost.stages[0].backward_s == pytest.approx(2 * (0.020 - 0.004) + 0.004)
    old = [replace(m, stage_program_s=0.0) for m in measured]  # a profile without it: the launch, as before
    assert estimate(_problem(old), decisions).stages[0].forward_s == pytest.approx(2 * (0.010 - 0.001) + 0.001)
    # A layer measured below the per-program cost (an embedding) pays less than nothing net, not nothing:
    # its stage costs its layers' net times plus the cost of each program it runs.
    small = [replace(measured[0], points=(LayerPoint(2, 0.001, 0.002, -1.0, 0.0),)), *measured[1:]]
    cost = estimate(_problem(small), decisions)
    assert cost.stages[0].forward_s == pytest.approx((0.001 - 0.004) + (0.010 - 0.004) + 0.004)
    assert cost.stages[0].backward_s == pytest.approx((0.002 - 0.004) + (0.020 - 0.004) + 0.004)
    alone = Decisions((StageDecision("A100", 2, 1, 0, 1), StageDecision("A100", 2, 1, 1, 3)), 2, "1f1b", (8,))
    assert estimate(_problem(small), alone).stages[0].forward_s == pytest.approx(0.001)  # alone: what it measured
    # Measured per microbatch size, the per-program cost is the one at the stage's examples per device.
    sized = [replace(m, points=(LayerPoint(1, 0.005, 0.010, -1.0, 0.0, stage_program_s=0.002),
                                LayerPoint(4, 0.020, 0.040, -1.0, 0.0, stage_program_s=0.008))) for m in measured]
    at_two = estimate(_problem(sized), decisions)  # 8 examples, 2 microbatches, 2 devices: 2 per device
    assert at_two.stages[0].forward_s == pytest.approx(2 * (0.010 - 0.004) + 0.004)


def test_the_last_stage_is_one_program_per_microbatch_at_its_layers_fused_times():
    # The last stage's forward and backward are one program (hetpar.compile.tasks): it pays one program's
    # cost per microbatch, not two, and a layer measured inside such a program (`fused_s`, with one
    # program's cost) costs that, less than its forward and backward apart (XLA fuses across the two).
    def layers(fused):
        return [MeasuredLayer("A100", layer, 1, 2, (LayerPoint(2, 0.010, 0.020, -1.0, 0.0, fused_s=fused if layer else 0.0),),
                              program_s=0.001, stage_program_s=0.004) for layer in range(3)]
    decisions = Decisions((StageDecision("A100", 2, 1, 0, 1), StageDecision("A100", 2, 1, 1, 3)), 2, "1f1b", (8,))
    apart = estimate(_problem(layers(0.0)), decisions)
    assert apart.stages[0].forward_s == pytest.approx(0.010) and apart.stages[0].backward_s == pytest.approx(0.020)
    last = apart.stages[1]
    assert last.forward_s == pytest.approx(2 * (0.010 - 0.004) + 0.004)  # the forward keeps its price
    assert last.forward_s + last.backward_s == pytest.approx(2 * (0.030 - 0.008) + 0.004)  # one program's cost
    fused = estimate(_problem(layers(0.024)), decisions).stages[1]
    assert fused.forward_s + fused.backward_s == pytest.approx(2 * (0.024 - 0.004) + 0.004)
    assert estimate(_problem(layers(0.024)), decisions).stages[0].backward_s == pytest.approx(0.020)  # not last: apart
    # The planner's stage table prices the last stage the same way, and its lower bounds stay below it.
    costs = StageCosts(_problem(layers(0.024)))
    table = costs.table(StageConfig("A100", 2, 1), 4, 1, last=True, m=2)
    assert table.forward[1, 3] + table.backward[1, 3] == pytest.approx(fused.forward_s + fused.backward_s)
    from solver.planner.bounds import LowerBounds
    runs = LowerBounds(costs.problem, costs)._stage_runs(StageConfig("A100", 2, 1), 4)
    assert runs.time[1] <= fused.forward_s + fused.backward_s  # two consecutive layers, at least


def test_a_shared_host_pays_the_runtimes_host_work_per_program_and_its_batch_split_per_pipeline():
    # The interpreter's own host work per stage program dispatched (`dispatch_s`) and cutting each pipeline's
    # batch into microbatches once per step (`split_s`): not in any program's time, so added on a shared host.
    def layers(dispatch, split):
        return tuple(MeasuredLayer("A100", layer, 1, 2, (LayerPoint(1, 0.010, 0.020, -1.0, 0.0, split_s=split),
                                                          LayerPoint(4, 0.040, 0.080, -1.0, 0.0, split_s=4 * split)),
                                   shared_host=True, program_s=0.001, stage_program_s=0.004, dispatch_s=dispatch)
                     for layer in range(3))

    def shared(measured):
        problem = _problem(measured)
        return replace(problem, kinds=tuple(replace(k, shared_host=True) for k in problem.kinds))

    two = Decisions((StageDecision("A100", 2, 1, 0, 2), StageDecision("A100", 2, 1, 2, 3)), 2, "1f1b", (8,))
    before, after = estimate(shared(layers(0.0, 0.0)), two), estimate(shared(layers(0.0005, 0.001)), two)
    first, last = (a.forward_s - b.forward_s + a.backward_s - b.backward_s for a, b in zip(after.stages, before.stages))
    assert first == pytest.approx(2 * 0.0005)  # a stage that is not the last: a forward and a backward program
    assert last == pytest.approx(0.0005)  # the last: one program a microbatch
    split = 0.001 + (0.004 - 0.001) / 3  # 2 examples a device: between the measured points
    assert after.step_s - before.step_s == pytest.approx(2 * (first + last) + split)
    replicas = Decisions(tuple(StageDecision("A100", 2, 1, 0, 3, replica=r) for r in range(2)), 2, "1f1b", (8, 8))
    more = estimate(shared(layers(0.0005, 0.001)), replicas).step_s - estimate(shared(layers(0.0, 0.0)), replicas).step_s
    assert more == pytest.approx(2 * 2 * 0.0005 + 2 * split)  # each pipeline splits its own batch
    # Elsewhere the host dispatches and splits while the devices compute: not priced.
    apart = estimate(_problem(layers(0.0005, 0.001)), two)
    assert apart.step_s == pytest.approx(estimate(_problem(layers(0.0, 0.0)), two).step_s)
    # The planner's lower bounds stay below the stage table that now pays them.
    from solver.planner.bounds import LowerBounds
    costs = StageCosts(shared(layers(0.0005, 0.001)))
    table = costs.table(StageConfig("A100", 2, 1), 8, 1, last=True, m=2)
    runs = LowerBounds(costs.problem, costs)._stage_runs(StageConfig("A100", 2, 1), 8)
    assert runs.time[0] <= table.forward[2, 3] + table.backward[2, 3]  # one layer, at least
    assert runs.time[1] <= table.forward[1, 3] + table.backward[1, 3]  # two consecutive layers, at least


def test_a_shared_hosts_replica_combine_is_priced_as_the_profile_measured_it():
    point = LayerPoint(2, 0.010, 0.020, -1.0, 0.0)
    measured = tuple(MeasuredLayer("A100", layer, 1, 2, (point,), shared_host=True, merge_s=0.003 * (layer + 1))
                     for layer in range(3))
    problem = _problem(measured)
    shared = replace(problem, kinds=tuple(replace(k, shared_host=True) for k in problem.kinds))
    three = Decisions(tuple(StageDecision("A100", 1, 1, 0, 3, replica=r) for r in range(3)), 1, "1f1b", (4, 2, 2))
    # every replica adds the 2 others' gradients of each layer into its own (3 x 2 merges), and replica 2 first
    # moves replica 0's to itself (one more, priced as a merge): 7 x (3 + 6 + 9) ms
    assert estimate(shared, three).cross_sync_s == pytest.approx(7 * 0.018)
    unmeasured = replace(shared, measured_layers=tuple(replace(m, merge_s=0.0) for m in measured))
    assert estimate(unmeasured, three).cross_sync_s < 0.001  # the collective's bytes alone


def test_one_more_programs_cost_is_the_layers_apart_against_a_stage_that_is_not_last():
    # A model of 5 layers: first, block x3, head. The reference stage holds the first 3 layers (first and two
    # blocks, a forward and a backward program); the last two (a block and the head) are one fused program.
    # Per program: (those 3 layers apart - the stage) / (6 - 2); not against the whole model fused, whose
    # fusion saving is no program's cost.
    def layer(name, count, before, fused=False, pair=False):
        record = LayerRecord(name, name, "cpu", "float32", 1, 2, True)
        return _Layer(record, 2, lambda: 0, None if fused else (lambda: 0), None, [], 0.5, 0, None, count,
                      send=lambda: 0, fused=(lambda: 0) if pair else None, before=before)

    layers = [layer("first", 1, 1), layer("block", 3, 2, pair=True), layer("head", 1, 0, fused=True)]
    timing = LayerTiming([lambda: 0] * 11, 1, [2], layers, [(2, 2)])
    # launch, reference stage; first fwd, bwd, send; block fwd, bwd, send, with the head; head (fused), send
    records = timing.records([0.001, 0.045, 0.002, 0.003, 0.0005, 0.010, 0.020, 0.0007, 0.040, 0.012, 0.0009])
    per_program = (0.005 + 2 * 0.030 - 0.045) / 4
    assert all(r.stage_program_s == pytest.approx(per_program) for r in records)
    assert all(r.points[0].stage_program_s == pytest.approx(per_program) for r in records)  # per size too
    assert all(r.program_s == 0.001 for r in records)
    assert [r.points[0].send_s for r in records] == [0.0005, 0.0007, 0.0009]  # the sends are not programs
    # Inside a last stage's program: the block is its program with the head less the head alone (with one
    # program's cost, as its forward has it); the head is its own program; the first was not measured so.
    first, block, head = (r.points[0] for r in records)
    assert block.fused_s == pytest.approx(0.040 - 0.012 + per_program)
    assert head.fused_s == pytest.approx(0.012) and head.forward_s + head.backward_s == pytest.approx(0.012)
    assert first.fused_s == 0.0
    with pytest.raises(HetparError, match="10 times for 11"):
        timing.records([0.0] * 10)
    # The runtime's host-cost runs after the reference stage: the interpreter alone over 8 dispatches, then the
    # batch split; per dispatch and per split on every record of the mesh.
    hosted = LayerTiming([lambda: 0] * 13, 1, [2], layers, [(2, 2)], hosts=[(2, 2, 8, True)])
    times = [0.001, 0.045, 0.0016, 0.0009, 0.002, 0.003, 0.0005, 0.010, 0.020, 0.0007, 0.040, 0.012, 0.0009]
    records = hosted.records(times)
    assert all(r.dispatch_s == pytest.approx(0.0002) and r.points[0].split_s == pytest.approx(0.0009) for r in records)
    assert [r.points[0].send_s for r in records] == [0.0005, 0.0007, 0.0009]  # the layers' runs as before
    # A layer's gradient sums finished over the data axis once a step: their work (less a launch, since a
    # step runs it inside the update program) is part of the layer's once-per-step time.
    finishing = [replace(layers[0], once=[lambda: 0], finish=lambda: 0), *layers[1:]]
    timing = LayerTiming([lambda: 0] * 13, 1, [2], finishing, [(2, 2)])
    # launch, reference; first fwd, bwd, send, finish, update; block fwd, bwd, send, with the head; head, send
    records = timing.records([0.001, 0.045, 0.002, 0.003, 0.0005, 0.0016, 0.004, 0.010, 0.020, 0.0007, 0.040, 0.012, 0.0009])
    assert records[0].points[0].once_s == pytest.approx(0.004 + 0.0006) and records[0].once_programs == 1


@pytest.fixture(scope="module")
def workload():
    return gpt.setup(batch_size=8)


def _signatures(workload, num_layers: int) -> list[str]:
    traced = trace_step(workload.step, (workload.state, workload.batch), 1, 1)
    return layer_signatures(traced.full, traced.analysis, layers_of(traced, num_layers))


def test_identical_blocks_share_a_signature_at_any_batch(workload):
    signatures = _signatures(workload, 6)  # embedding, 4 blocks, head
    assert len(set(signatures[1:5])) == 1 and len(set(signatures)) == 3
    other = gpt.setup(batch_size=4)
    assert _signatures(other, 6) == signatures  # the batch dimension is not part of a layer's signature


def test_plans_and_show_say_which_layers_were_measured(workload, tmp_path, capsys):
    block = _signatures(workload, 6)[1]
    slow = [LayerPointRecord(e, 0.05 * e, 0.1 * e, -1.0, 0.01) for e in (1, 2)]
    Profile({}, layers=[LayerRecord(block, "Block_0", "A100", "float32", 1, 2, False, slow)]).save(tmp_path / "p.json")
    cluster = hetpar.Cluster.virtual({"A100": 4, "V100": 4})
    args = (workload.state, workload.batch)
    options = dict(num_microbatches=2, num_stages=2, num_layers=6)
    plain = hetpar.make_plan(workload.step, args, cluster, **options)
    plan = hetpar.make_plan(workload.step, args, cluster, profile=str(tmp_path / "p.json"), **options)
    measured = plan.cost_inputs.measured_layers
    assert {m.layer for m in measured} == {1, 2, 3, 4} and {m.kind for m in measured} == {"A100"}
    a100 = next(s for s in plan.stages if s.device_type == "A100")
    assert a100.forward_s > next(s for s in plain.stages if s.device_type == "A100").forward_s
    save_plan(plan, tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["estimator_version"] == ESTIMATOR_VERSION
    assert load_plan(tmp_path / "plan.json").cost_inputs.measured_layers == measured
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    blocks = [layer for layer in range(a100.layer_start, a100.layer_end) if layer in (1, 2, 3, 4)]
    assert blocks, "the A100 stage holds blocks"
    assert f"layers on A100: measured (profile) {blocks[0]}-{blocks[-1]}" in out
    assert "layers on V100: measured (profile) none" in out


@pytest.mark.parametrize("made_under, warned", [("0.0.1", True), (jax.__version__, False)])
def test_a_profile_traced_under_another_jax_is_named_where_layers_go_unmatched(workload, tmp_path, caplog, made_under, warned):
    block = _signatures(workload, 6)[1]
    record = LayerRecord(block, "Block_0", "A100", "float32", 1, 2, False, [LayerPointRecord(2, 0.1, 0.2, -1.0, 0.01)])
    Profile({}, layers=[record], jax_version=made_under).save(tmp_path / "p.json")
    cluster = hetpar.Cluster.virtual({"A100": 4, "V100": 4})
    with caplog.at_level("WARNING", logger="hetpar.pipeline"):
        hetpar.make_plan(workload.step, (workload.state, workload.batch), cluster, profile=str(tmp_path / "p.json"),
                         num_microbatches=2, num_stages=2, num_layers=6)
    said = [r.getMessage() for r in caplog.records if "match no record" in r.getMessage()]
    # the embedding and the head are A100's unmatched layers; V100 has no records, so nothing is said of it
    assert said == ([f"A100: 2 of the step's 6 layers match no record of the profile, which JAX 0.0.1 traced; this is "
                     f"JAX {jax.__version__}, which may trace a layer as other operators: profile under this JAX for "
                     "measured prices"] if warned else [])


def test_profiling_a_steps_layers_records_each_distinct_layer(workload):
    with pytest.raises(HetparError, match="one example"):
        layer_timing(workload.step, (workload.state, workload.batch), [0, 1], "cpu", examples=(1, 2), data_parallel=(1,))
    records = layer_timing(workload.step, (workload.state, workload.batch), [0, 1], "cpu", examples=(2, 4),
                           data_parallel=(1, 2), num_layers=6, remat=True).measure(rounds=1)
    assert len(records) == 6  # 3 distinct layers (embedding, block, head) x 2 data-parallel degrees
    assert {r.dp for r in records} == {1, 2} and all(r.shared_host and r.dtype == "float32" for r in records)
    for r in records:
        assert [p.examples for p in r.points] == [2, 4]
        assert r.program_s > 0 and r.once_programs >= 1 and r.stage_program_s >= r.program_s and r.merge_s > 0
        assert all(p.forward_s > 0 and p.backward_s > 0 and p.once_s > 0 and p.peak_bytes > 0 for p in r.points)
    block = next(r for r in records if r.name == "Block_0" and r.dp == 1)
    assert all(p.backward_remat_s > 0 for p in block.points)
    # a layer fed by the one before it measured that input's arrival from another mesh; the first, fed by the batch, not
    assert all(p.send_s > 0 for r in records if r.name != records[0].name for p in r.points)
    assert all(p.send_s == 0 for r in records if r.name == records[0].name for p in r.points)
    # the last layer and the one before it measured inside one program, as a last stage runs them; the first not
    assert all(p.fused_s > 0 for r in records if r.name != records[0].name for p in r.points)
    assert all(p.fused_s == 0 for r in records if r.name == records[0].name for p in r.points)
    assert all(r.dispatch_s == 0 and all(p.split_s == 0 for p in r.points) for r in records)  # no runtime given


def test_runs_share_zero_arguments_of_one_shape_dtype_and_sharding(workload):
    """A profile's runs take zero-filled arguments (`program_inputs`); with one dict of
    zeros for them all, a weight several programs read (the forward and the backward,
    the plain and the recomputing one) is one array, not one per program (with a copy
    per program a 1.26B Llama's profile ran out of a 141 GB GPU's memory)."""
    from hetpar.compile.programs import stage_mesh
    from hetpar.compile.step import compile_layer_stages
    from hetpar.predict.calibrate import program_inputs
    from hetpar.predict.layer_profile import with_batch

    traced = trace_step(workload.step, with_batch((workload.state, workload.batch), 1, 4), 1, 2)
    layers = layers_of(traced, 2)
    mesh = stage_mesh((0,))
    step = compile_layer_stages(traced, layers, [0, 1], {0: mesh, 1: mesh})
    fwd, bwd = (next(p for p in step.programs if p.task.stage == 0 and p.task.kind == kind) for kind in ("fwd", "bwd"))
    read_by_both = set(fwd.task.inputs) & set(bwd.task.inputs)
    assert read_by_both, "the backward reads the forward's weights"
    zeros: dict = {}
    first, second = program_inputs(fwd, step.graph, zeros), program_inputs(bwd, step.graph, zeros)
    for v in read_by_both:
        assert first[fwd.task.inputs.index(v)] is second[bwd.task.inputs.index(v)]
    assert len(zeros) < len(fwd.task.inputs) + len(bwd.task.inputs)
    alone = program_inputs(fwd, step.graph)  # without the dict, arrays of its own
    assert all(a is not b for a, b in zip(alone, first))


@pytest.mark.parametrize("flags, host_cpu", [((), False), (("--host-cpu",), True)])
def test_the_layer_profile_times_the_host_cpu_beside_accelerators_only_when_asked(tmp_path, monkeypatch, flags, host_cpu):
    """On a machine with accelerators `Cluster.local()` holds the host's CPU as one more
    kind; `hetpar profile --layers` asks for it only with `--host-cpu` (here, where the
    CPU is the only kind, it is profiled either way)."""
    from hetpar.cluster.cluster import Cluster

    asked, local = [], Cluster.local
    monkeypatch.setattr(Cluster, "local", staticmethod(lambda include_cpu=True: asked.append(include_cpu) or local(include_cpu)))
    path = tmp_path / "layers.json"
    assert main(["profile", "-o", str(path), "--mesh-size", "1", "--layers", "mlp", "--microbatch-sizes", "2",
                 "--rounds", "1", "--no-remat", *flags]) == 0
    assert asked[-1] is host_cpu  # the layer profile's (the device profile before it asks the same)
    assert {r.device_kind for r in Profile.load(path).layers} == {"cpu"}


@pytest.mark.parametrize("sizes, fix", [("4,8", "--microbatch-sizes 4"), ("2,3", "profile on devices with more memory")])
def test_a_layer_profile_out_of_device_memory_says_which_sizes_and_what_to_profile(monkeypatch, capsys, tmp_path, sizes, fix):
    """Out of memory XLA names an allocation deep in a compile; the CLI says which kind
    and sizes ran out and what to profile instead (a 1.26B Llama at 4 examples on an
    H100 did). Other runtime errors pass through as they are."""
    import jax

    from hetpar.predict import layer_profile

    def out_of_memory(*_, **__):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 22.00MiB")

    monkeypatch.setattr(layer_profile, "layer_timing", out_of_memory)
    command = ["profile", "-o", str(tmp_path / "p.json"), "--mesh-size", "1", "--layers", "mlp", "--microbatch-sizes", sizes]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"mlp's layers ran out of cpu's memory at microbatch sizes {sizes}" in err and fix in err
    assert "Out of memory while trying to allocate 22.00MiB" in err

    def broken(*_, **__):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(layer_profile, "layer_timing", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        main(command)


def test_profiling_measures_the_runtimes_host_work(workload):
    from hetpar.runtime.host_cost import host_runs

    timing = layer_timing(workload.step, (workload.state, workload.batch), [0, 1], "cpu", examples=(2,),
                          data_parallel=(2,), num_layers=6, remat=False, host=host_runs)
    assert len(timing.hosts) == 1 and timing.hosts[0][2] >= 6  # a 2-stage step of 2 microbatches: 6 programs or more
    # on 2 devices every layer's gradient sums are partial per device, finished over the data axis once a step
    assert all(layer.finish is not None for layer in timing.layers)
    records = timing.measure(rounds=1)
    assert all(r.dispatch_s > 0 and all(p.split_s > 0 for p in r.points) for r in records)
    # the interpreter alone is host work only: well under one program of the block it dispatches
    block = next(r for r in records if r.name == "Block_0")
    assert block.dispatch_s < block.points[0].forward_s


def test_the_runtimes_host_work_is_recorded_before_the_profiles_runs_hold_arrays(workload):
    """The reference step's real run (its state, new state and activations) comes
    before the layer runs make their zeros and accumulators: with both at once, and
    the model's own values held beside them, a 1.26B Llama's profile at 4 examples ran
    out of an H100's memory."""
    import jax

    from hetpar.runtime.host_cost import host_runs
    from hetpar.workloads import StepAndArgs

    def live_bytes() -> int:
        return sum(a.nbytes for a in jax.live_arrays() if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended))

    step = StepAndArgs("gpt", workload.step, (workload.state, workload.batch)).abstract()
    assert not any(isinstance(x, jax.Array) for x in jax.tree.leaves(step.args)) and len(step.args) == 2
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(workload.state) if isinstance(x, jax.Array))
    before, at_host = live_bytes(), []
    timing = layer_timing(step.step, step.args, [0], "cpu", examples=(2,), num_layers=6, remat=True,
                          host=lambda ref: at_host.append(live_bytes()) or host_runs(ref))
    assert len(at_host) == 1 and at_host[0] - before < 0.05 * state_bytes
    assert live_bytes() - before > 0.5 * state_bytes  # the runs made after hold the zeros and accumulators
    assert timing.hosts


def test_float32_matmuls_are_priced_at_the_precision_jax_runs_them():
    import jax

    from hetpar.cluster.catalog import device_type
    from hetpar.predict.layer_profile import dtype_policy

    a100, v100 = device_type("A100"), device_type("V100")
    assert a100.matmul_flops("float32") == a100.flops("tf32") > a100.flops("fp32")  # JAX's default: TF32 on Ampere
    assert v100.matmul_flops("float32") == v100.flops("fp32")  # no TF32 units
    assert dtype_policy("float32") == "float32"
    with jax.default_matmul_precision("highest"):
        assert a100.matmul_flops("float32") == a100.flops("fp32")
        assert dtype_policy("float32") == "float32/highest"  # a profile taken at full precision keys apart
    assert a100.matmul_flops("bfloat16") == a100.flops("bf16")

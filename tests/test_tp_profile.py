"""Measured layer profiles at tensor-parallel degrees above 1 (hetpar/predict/tp_profile.py):
the profiler runs each layer as the sharding pass lays out a stage of it on a data x
model mesh, records it keyed by that degree, and the estimator prices a stage of that
degree from those records (and from the model where none has its degree). A tiny GPT
(2 blocks), one microbatch size, one timed round: correctness, not speed."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import hetpar
from hetpar.cli import main
from hetpar.errors import HetparError
from hetpar.pipeline import layers_of
from hetpar.plan.costs import estimate_plan
from hetpar.predict.layer_profile import layer_timing, with_batch
from hetpar.predict.profile import Profile
from hetpar.predict.tp_profile import Pooled, layer_layouts
from hetpar.shard import shard_stages
from hetpar.trace.traced_step import trace_step
from models import gpt

NUM_LAYERS = 4  # embedding, 2 blocks, head


@pytest.fixture(scope="module")
def workload():
    return gpt.setup(batch_size=8, config=gpt.GPTConfig(n_layers=2))


@pytest.fixture(scope="module")
def records(workload):
    timing = layer_timing(workload.step, (workload.state, workload.batch), [0, 1, 2, 3], "cpu", examples=(2,),
                          data_parallel=(1,), num_layers=NUM_LAYERS, remat=False, tensor_parallel=(1, 2), shard=shard_stages)
    assert isinstance(timing, Pooled) and len(timing.parts) == 2  # one timing per degree, one pool
    return timing.measure(rounds=1)


def test_a_layer_at_tp2_runs_as_the_sharding_pass_lays_out_a_stage_of_it(workload):
    traced = trace_step(workload.step, with_batch((workload.state, workload.batch), 1, 4), 1, 2)
    layers = layers_of(traced, NUM_LAYERS)
    laid = layer_layouts(traced, layers, list(range(NUM_LAYERS)), [0, 1], (1, 2), "cpu", shard_stages)
    block = laid[1]
    # the block's matmul weights and results split over the model axis, each matmul's operands pinned
    assert any("model" in spec for spec in block["specs"].values()) and block["operand_specs"]
    assert layer_layouts(traced, layers, list(range(NUM_LAYERS)), [0], (1, 1), "cpu", shard_stages) is None  # tp 1: none
    with pytest.raises(HetparError, match="sharding pass"):
        layer_layouts(traced, layers, list(range(NUM_LAYERS)), [0, 1], (1, 2), "cpu", None)


def test_a_profile_at_tp2_has_records_keyed_by_that_degree(records):
    by_tp = {tp: {r.name for r in records if r.tp == tp} for tp in (1, 2)}
    assert by_tp[1] == by_tp[2] and len(by_tp[2]) == 3  # embedding, block, head: each at both degrees
    for r in records:
        assert r.dp == 1 and r.key[3] == r.tp and r.program_s > 0 and r.merge_s > 0
        for p in r.points:
            assert all(math.isfinite(t) and t > 0 for t in (p.forward_s, p.backward_s, p.once_s)) and p.peak_bytes > 0


def _plan(workload, path, mesh_shape=(1, 2)):
    cluster = hetpar.Cluster.virtual({"cpu": 2})
    return hetpar.make_plan(workload.step, (workload.state, workload.batch), cluster, num_microbatches=2, num_stages=1,
                            num_layers=NUM_LAYERS, mesh_shape=mesh_shape, profile=str(path))


def test_a_tp2_stage_is_priced_from_the_tp2_records_and_from_the_model_without_them(workload, records, tmp_path, capsys):
    Profile({}, layers=records).save(tmp_path / "p.json")
    plan = _plan(workload, tmp_path / "p.json")
    assert plan.stages[0].tensor_parallel == 2
    measured = plan.cost_inputs.measured_layers
    assert {m.tp for m in measured} == {1, 2} and {m.layer for m in measured if m.tp == 2} == set(range(NUM_LAYERS))
    inputs = plan.cost_inputs

    def priced(layers) -> float:  # noqa: ANN001
        return estimate_plan(replace(plan, cost_inputs=replace(inputs, measured_layers=tuple(layers)))).step_s

    base = priced(measured)
    # A tp2 record's time is what the stage is priced at: doubling one block's doubles its share.
    slower = [replace(m, points=tuple(replace(p, forward_s=2 * p.forward_s + 0.05) for p in m.points))
              if m.tp == 2 and m.layer == 1 else m for m in measured]
    assert priced(slower) > base + 2 * 0.05  # two microbatches, each 50 ms more at least
    # The tp1 records do not price a tp2 stage: changing them changes nothing, and without the tp2 ones
    # the stage is priced from the model, as with no records at all.
    tp1_slower = [replace(m, points=tuple(replace(p, forward_s=10 * p.forward_s) for p in m.points)) if m.tp == 1 else m
                  for m in measured]
    assert priced(tp1_slower) == pytest.approx(base)
    assert priced([m for m in measured if m.tp == 1]) == pytest.approx(priced([]))
    assert priced([m for m in measured if m.tp == 1]) != pytest.approx(base)
    from hetpar.plan.file import save_plan
    save_plan(plan, tmp_path / "plan.json")
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    assert "layers on cpu (tp 2): measured (profile) 0-3; modelled none" in capsys.readouterr().out


def test_the_cli_profiles_the_tensor_parallel_degrees_it_is_given(tmp_path, capsys):
    path = tmp_path / "layers.json"
    assert main(["profile", "-o", str(path), "--mesh-size", "1", "--layers", "mlp", "--microbatch-sizes", "2",
                 "--data-parallel", "2,8", "--tp", "2", "--rounds", "1", "--no-remat"]) == 0
    records = Profile.load(path).layers
    assert {(r.dp, r.tp) for r in records} == {(2, 2)}  # 8 x 2 is more devices than there are: left out
    assert all(p.forward_s > 0 and p.once_s > 0 for r in records for p in r.points)
    assert "(data x model)" in capsys.readouterr().out
    assert main(["profile", "-o", str(path), "--mesh-size", "1", "--layers", "mlp", "--tp", "2,0"]) == 2
    assert "--tensor-parallel needs positive numbers" in capsys.readouterr().err

"""ZeRO over a stage's data axis (optimizer state, gradients, parameters sharded):
parity with one device at every stage, alone and beside model-axis splits, the
layouts it writes into the plan, and the collectives its compiled programs hold."""

from __future__ import annotations

import re

import pytest

import hetpar
import hetpar.shard as shard
from hetpar.errors import PlanError
from hetpar.options import ShardingOption, StageOption
from hetpar.plan.file import load_plan, save_plan
from models import gpt, mlp
from parity import run_parity

TWO_TYPES = {"A100": 4, "V100": 4}
UNIFORM = StageOption(mode="uniform")  # stages of equal layers, so every stage holds parameters


def _mlp():
    return mlp.setup(batch_size=16, hidden=32, depth=3)  # Adam (adamw), as every reference model


def _data_sharded(stage) -> set[int]:
    return {v for v, spec in stage.shardings if "data" in spec}


@pytest.mark.parametrize("zero, schedule", [(1, "gpipe"), (2, "1f1b"), (3, "gpipe"), (3, "1f1b")])
def test_zero_stage_parity_on_data_parallel_stages(zero, schedule):
    """Two device types, a 4-way data axis per stage, two steps (so the sharded
    optimizer state and, at ZeRO-3, the sharded parameters carry across steps)."""
    plan = run_parity(_mlp(), hetpar.Cluster.virtual(TWO_TYPES), steps=2, num_stages=2, num_layers=4, num_microbatches=2,
                      schedule=schedule, stage_option=UNIFORM, sharding_option=ShardingOption(zero=zero))
    for stage in plan.stages:
        assert stage.zero == zero and stage.mesh_shape == (4,)
        assert _data_sharded(stage), "ZeRO laid nothing over the data axis"
        assert bool(stage.gathered) == (zero == 3)


def test_zero3_beside_model_axis_parity():
    """A data x model stage (the ILP's Megatron-style split) and a data-parallel one,
    both ZeRO-3: parameters carry both axes, gathered over data only."""
    plan = run_parity(gpt.setup(batch_size=8), hetpar.Cluster.virtual(TWO_TYPES), steps=2, num_stages=2, num_layers=2,
                      num_microbatches=2, mesh_shape=((2, 2), (4, 1)), schedule="1f1b", sharding_option=ShardingOption(zero=3))
    first = plan.stages[0]
    assert first.mesh_shape == (2, 2) and first.zero == 3
    both = [spec for _, spec in first.shardings if "data" in spec and "model" in spec]
    assert both, "no parameter is split over both axes"
    assert all("data" not in spec for _, spec in first.gathered)  # gathered over data, model splits kept


def test_zero_over_three_device_types_parity():
    """H100, A100 and V100 stages at ZeRO-2, one of them with a model axis."""
    cluster = hetpar.Cluster.virtual({"H100": 2, "A100": 4, "V100": 2})
    plan = run_parity(_mlp(), cluster, steps=2, num_stages=3, num_layers=3, num_microbatches=2,
                      mesh_shape=((2, 1), (2, 2), (2, 1)), stage_option=UNIFORM, sharding_option=ShardingOption(zero=2))
    assert [s.device_type for s in plan.stages] == ["H100", "A100", "V100"]
    assert all(s.zero == 2 and _data_sharded(s) for s in plan.stages)


def test_zero_mixed_per_parameter_parity(monkeypatch):
    """The choice is per parameter: parameters of one stage at ZeRO 0, 1, 2 and 3
    side by side (as `choose_zero` picks under memory pressure) still give jit's
    numbers, and the stage reports its highest level."""
    picked = []

    def mixed(items, *args, **kwargs):
        levels = [k % 4 for k in range(len(items))]
        picked.append(levels)
        return levels

    monkeypatch.setattr(shard, "choose_zero", mixed)
    cluster = hetpar.Cluster.virtual(TWO_TYPES)
    plan = run_parity(_mlp(), cluster, steps=2, num_stages=2, num_layers=4, num_microbatches=2, stage_option=UNIFORM)
    assert picked and all(len(levels) >= 4 for levels in picked)
    assert [s.zero for s in plan.stages] == [3, 3]
    # Only the parameters chosen for ZeRO-3 are gathered; the others arrive whole.
    for stage, levels in zip(plan.stages, picked):
        assert len(stage.gathered) == levels.count(3)


def test_zero_plan_round_trip(tmp_path):
    workload = _mlp()
    plan = hetpar.make_plan(workload.step, (workload.state, workload.batch), hetpar.Cluster.virtual(TWO_TYPES),
                            num_stages=2, num_layers=4, num_microbatches=2, stage_option=UNIFORM,
                            sharding_option=ShardingOption(zero=3))
    save_plan(plan, tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded == plan
    assert [s.zero for s in loaded.stages] == [3, 3] and all(s.gathered for s in loaded.stages)


def test_zero_option_is_checked():
    with pytest.raises(PlanError, match="ShardingOption.zero"):
        hetpar.make_plan(mlp.setup().step, (mlp.setup().state, mlp.setup().batch), hetpar.Cluster.virtual({"cpu": 2}),
                         sharding_option=ShardingOption(zero=4))


def test_zero_default_keeps_state_whole_when_it_fits():
    """zero=None: ZeRO only where memory asks for it; the virtual devices' catalog
    memory holds this model many times over, so no stage shards its state."""
    workload = _mlp()
    plan = hetpar.make_plan(workload.step, (workload.state, workload.batch), hetpar.Cluster.virtual(TWO_TYPES),
                            num_stages=2, num_layers=4, num_microbatches=2, stage_option=UNIFORM)
    assert all(s.zero == 0 and not s.gathered and not _data_sharded(s) for s in plan.stages)


def _collectives(text: str, name: str) -> list[str]:
    """The result types of every `name` instruction (a tuple-typed one gives each)."""
    found = []
    for result in re.findall(rf"= (.+?) {name}(?:-start)?\(", text):
        found += re.findall(r"\w+\[[\d,]*\]", result)
    return found


def test_zero3_compiled_programs_gather_parameters_and_scatter_gradients():
    """A ZeRO-3 stage's backward all-gathers its parameters, reduce-scatters its
    gradients, and all-reduces nothing of a gradient's full size; the parameters the
    step returns stay sharded."""
    workload = mlp.setup(batch_size=16, hidden=64, depth=2)
    par = hetpar.parallelize(workload.step, cluster=hetpar.Cluster.virtual({"cpu": 8}), num_stages=2, num_layers=2,
                             num_microbatches=2, stage_option=UNIFORM, sharding_option=ShardingOption(zero=3))
    state, _ = par(workload.state, workload.batch)
    assert "data" in state.params["params"]["Block_1"]["Dense_0"]["kernel"].sharding.spec
    step = par.compiled()

    def gradients(program):
        return {f"f32[{','.join(map(str, step.graph.avals[v].shape))}]" for v in program.task.reductions
                if step.graph.avals[v].shape}

    # The program that computes the hidden 64x64 weight's gradient (a backward, or the
    # last stage's forward and backward as one program).
    (bwd,) = [p for p in step.programs if p is not None and "f32[64,64]" in gradients(p)]
    text = bwd.lower().compile().as_text()
    assert "f32[64,64]" in _collectives(text, "all-gather")  # the hidden weight, gathered for the backward
    scattered = _collectives(text, "reduce-scatter")
    assert "f32[16,64]" in scattered or "f32[64,16]" in scattered, scattered  # its gradient, a quarter per device
    assert not gradients(bwd) & set(_collectives(text, "all-reduce")), "a gradient is all-reduced whole"

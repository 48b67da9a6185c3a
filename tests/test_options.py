"""Option objects: each pass takes its own, `parallelize` forwards them, shortcuts
agree with them or are refused, and every planning pass logs its time."""

import logging

import pytest

import hetpar
from hetpar.errors import HetparError, PlanError
from hetpar.options import ShardingOption, StageOption, build_options
from models import gpt, mlp
from parity import run_parity


def test_shortcuts_fill_the_option_objects():
    stage, sharding, runtime = build_options(num_stages=2, schedule="1f1b", mesh_shape=[2, 2], runtime="local")
    assert stage == StageOption(mode="manual", num_stages=2, schedule="1f1b")
    assert sharding.mesh_shape == (2, 2) and runtime.runtime == "local"


def test_a_shortcut_that_disagrees_with_its_option_object_is_refused():
    with pytest.raises(HetparError, match="num_stages=3 disagrees with stage_option.num_stages=2"):
        build_options(StageOption(mode="manual", num_stages=2), num_stages=3)
    # Agreeing, or filling a field the object leaves at its default, is fine.
    assert build_options(StageOption(time_limit_s=5.0), num_stages=2)[0].num_stages == 2


@pytest.mark.parametrize("option, message", [
    (StageOption(mode="sideways"), "StageOption.mode 'sideways'"),
    (StageOption(time_limit_s=-1.0), "time_limit_s must be positive"),
    (StageOption(remat="some"), "StageOption.remat 'some' is not a recomputation policy"),
    (ShardingOption(model_axis_margin=1.5), "model_axis_margin"),
])
def test_impossible_options_are_named(option, message):
    kind = "stage_option" if isinstance(option, StageOption) else "sharding_option"
    with pytest.raises(PlanError, match=message):
        hetpar.parallelize(lambda s, b: s, cluster=hetpar.Cluster.virtual({"cpu": 2}), **{kind: option})


def test_uniform_mode_gives_every_stage_the_same_layers_and_keeps_parity():
    plan = run_parity(mlp.setup(batch_size=8, depth=4), hetpar.Cluster.virtual({"A100": 4, "V100": 4}), steps=1,
                      num_microbatches=2, num_layers=4, stage_option=StageOption(mode="uniform", num_stages=2))
    assert [s.num_layers for s in plan.stages] == [2, 2]


def test_manual_mode_gives_the_faster_kind_more_layers():
    w = gpt.setup(batch_size=8, config=gpt.GPTConfig(n_layers=6))
    plan = hetpar.make_plan(w.step, (w.state, w.batch), hetpar.Cluster.virtual({"H100": 4, "V100": 4}),
                            num_microbatches=2, num_stages=2, num_layers=8)
    assert plan.stages[0].device_type == "H100" and plan.stages[0].num_layers > plan.stages[1].num_layers


def test_every_planning_pass_logs_its_time(caplog):
    w = mlp.setup(batch_size=8)
    with caplog.at_level(logging.INFO, logger="hetpar.passes"):
        hetpar.make_plan(w.step, (w.state, w.batch), hetpar.Cluster.virtual({"A100": 2, "V100": 2}), num_microbatches=2)
    logged = [r.getMessage().split(":")[0] for r in caplog.records if r.name == "hetpar.passes"]
    assert logged == ["pass layers", "pass stage assignment", "pass sharding", "pass placement"]


def test_planning_announces_each_pass_and_each_stage_it_shards():
    """What `hetpar solve` shows on its progress line (`hetpar.passes.announcing`):
    each pass as it starts, the second search where the best plan leaves a kind idle
    (here the V100s), and each stage's sharding solve, the longest part of planning
    a large model."""
    from hetpar.passes import announcing

    w = mlp.setup(batch_size=8)
    heard: list[str] = []
    with announcing(heard.append):
        plan = hetpar.make_plan(w.step, (w.state, w.batch), hetpar.Cluster.virtual({"A100": 2, "V100": 2}), num_microbatches=2)
    stages = [f"sharding stage {s.index + 1} of {len(plan.stages)} ({s.num_devices} {s.device_type})" for s in plan.stages]
    idle = [f"the best plan that also uses {line.split(' idle:')[0]}" for line in plan.notes if " idle:" in line]
    assert idle and heard == ["the layers pass", "the stage assignment pass", *idle, "the sharding pass", *stages,
                              "the placement pass"]
    hetpar.make_plan(w.step, (w.state, w.batch), hetpar.Cluster.virtual({"A100": 2, "V100": 2}), num_microbatches=2)
    assert len(heard) == 4 + len(idle) + len(stages)  # the listener is gone after its block

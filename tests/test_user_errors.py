"""Mistakes users make, answered in their terms: which argument, what it is, and the
fix; and `hetpar solve file.py:FN` importing like `python file.py`."""

from __future__ import annotations

import jax
import pytest

import hetpar
from hetpar.errors import HetparError
from hetpar.signature import bind_call
from hetpar.workloads import load_workload


def _step(state, batch, lr):
    return state, batch


def test_a_forgotten_static_argnums_names_the_argument_and_the_fix():
    with pytest.raises(HetparError, match=r"argument 2 \('lr'\) is a str \('fast'\).*static_argnums=\(2,\)"):
        bind_call(_step, ({"w": jax.numpy.ones(2)}, jax.numpy.ones(4), "fast"), {}, 1)
    with pytest.raises(HetparError, match=r"argument 0 \('state'\)\['opt'\] is a object"):
        bind_call(_step, ({"opt": object()}, jax.numpy.ones(4), 0.1), {}, 1)
    # What JAX traces passes: arrays, Python numbers, typed PRNG keys, abstract shapes.
    bind_call(_step, ({"key": jax.random.key(0), "n": 3}, jax.ShapeDtypeStruct((4,), "float32"), 0.1), {}, 1)
    bind_call(_step, ({"w": 1.0}, jax.numpy.ones(4), "fast"), {}, 1, static_argnums=(2,))


def test_a_parallelized_step_says_it_before_tracing():
    step = hetpar.parallelize(_step, cluster=hetpar.Cluster.virtual({"A100": 2}))
    with pytest.raises(HetparError, match="static_argnums"):
        step({"w": jax.numpy.ones(2)}, jax.numpy.ones(4), "fast")


def test_solve_imports_a_file_like_python_does(tmp_path):
    """`hetpar solve path/to/train.py:setup` lets train.py import the modules beside it."""
    (tmp_path / "my_model_lib.py").write_text("from models import mlp\n\ndef build():\n    return mlp.setup(batch_size=8, depth=2)\n")
    (tmp_path / "train_script.py").write_text("import my_model_lib\n\ndef setup(batch_size=None):\n    return my_model_lib.build()\n")
    workload = load_workload(f"{tmp_path / 'train_script.py'}:setup")
    assert workload.step is not None and len(workload.args) == 2


@pytest.mark.parametrize("options, message", [
    (dict(num_stages="2"), r"StageOption.num_stages must be a valid integer, got '2' \(str\)"),
    (dict(num_stages=True), r"StageOption.num_stages must be a valid integer, got True \(bool\)"),
    (dict(sharding_option=hetpar.ShardingOption(zero=2.0)), r"ShardingOption.zero must be a valid integer, got 2.0"),
    (dict(mesh_shape=(-1, 2)), r"mesh_shape \(-1, 2\): each mesh is \(data, model\) with positive whole numbers"),
    (dict(stage_option=hetpar.StageOption(layer_overhead_s=-1)), r"layer_overhead_s is seconds per layer, at least 0"),
    (dict(stage_option=hetpar.StageOption(time_limit_s=float("nan"))), r"time_limit_s must be a finite number, got nan"),
    (dict(stage_option=hetpar.StageOption(finalists=0)), r"finalists must be at least 1, got 0"),
])
def test_options_are_typed_at_the_boundary(options, message):
    """A string count, a float ZeRO stage (which a plan file could not load back), a
    negative mesh or overhead, NaN: each refused in one line naming the field."""
    from hetpar.options import build_options

    with pytest.raises(hetpar.PlanError, match=message):
        build_options(**options)
    build_options(mesh_shape=[2, 4], stage_option=hetpar.StageOption(time_limit_s=3))  # a list and an int are fine


def test_solve_time_limit_returns_the_best_plan_found_or_says_it_found_none(tmp_path, capsys):
    """`solve --time-limit`: a limit too short for a proof keeps the best plan found
    and says in its notes how far from the best it may be; one too short for any
    plan says that, not "no plan fits"."""
    from hetpar.cli import main
    from hetpar.plan.file import load_plan

    assert main(["solve", "gpt", "--cluster", "examples/clusters/two_types.yaml", "--time-limit", "-1",
                 "-o", str(tmp_path / "x.json")]) == 2
    assert "--time-limit: Input should be greater than 0 (got -1.0)" in capsys.readouterr().err
    assert main(["solve", "gpt", "--cluster", "examples/clusters/two_types.yaml", "--finalists", "0",
                 "-o", str(tmp_path / "x.json")]) == 2
    assert "--finalists: Input should be greater than or equal to 1 (got 0)" in capsys.readouterr().err
    out = tmp_path / "plan.json"
    code = main(["solve", "gpt", "--cluster", "examples/clusters/two_types.yaml", "--time-limit", "1e-6", "-o", str(out)])
    if code == 0:
        notes = " ".join(load_plan(str(out)).notes)
        assert "the search stopped at its time limit (1e-06 s): this plan's step time is within" in notes, notes
    else:
        assert code == 2
        assert "no plan found within the time limit of 1e-06 s; allow more time" in capsys.readouterr().err

"""Profiles feed planning: the measured figures of a `hetpar profile` file price the
device kinds it has, in the planner, hand-made plans and every view (`show` says
which kinds were measured)."""

from __future__ import annotations

import pytest

import hetpar
from hetpar.cli import main
from hetpar.plan.costs import estimate_plan
from hetpar.plan.file import save_plan
from hetpar.predict.compute import ComputeModel
from hetpar.predict.profile import DeviceProfile, Profile
from models import gpt

CLUSTER = {"A100": 4, "V100": 4}


def _synthetic_profile(path, matmul_flops: float) -> None:
    """An A100 measured far slower than its datasheet (the figures a profile records)."""
    compute = ComputeModel("A100", matmul_flops=matmul_flops, half_flops=2e9, vector_flops=1e11, memory_bandwidth=1e11,
                           op_overhead_s=1e-6, program_overhead_s=1e-5, calibrated=True)
    Profile({"A100": DeviceProfile("A100", 4, compute, 1e-5, 5e9)}).save(path)


@pytest.fixture(scope="module")
def workload():
    return gpt.setup(batch_size=8)


def test_a_profile_prices_the_kinds_it_measured(workload, tmp_path):
    _synthetic_profile(tmp_path / "profile.json", matmul_flops=1e11)
    args, cluster = (workload.state, workload.batch), hetpar.Cluster.virtual(CLUSTER)
    catalog = hetpar.make_plan(workload.step, args, cluster, num_microbatches=2, num_stages=2)
    measured = hetpar.make_plan(workload.step, args, cluster, num_microbatches=2, num_stages=2,
                                stage_option=hetpar.StageOption(profile=str(tmp_path / "profile.json")))
    kinds = {k.name: k for k in measured.cost_inputs.kinds}
    assert kinds["A100"].measured and kinds["A100"].flops == 1e11 and not kinds["V100"].measured
    a100 = lambda plan: next(s for s in plan.stages if s.device_type == "A100")  # noqa: E731
    # Far slower measured matmuls: the A100 stage costs more, and the plan gives it fewer layers.
    assert a100(measured).num_layers < a100(catalog).num_layers or a100(measured).forward_s > a100(catalog).forward_s
    assert measured.predicted_step_time_s > catalog.predicted_step_time_s
    assert estimate_plan(measured).step_s == measured.predicted_step_time_s


def test_the_planner_and_show_use_the_profile(workload, tmp_path, capsys):
    _synthetic_profile(tmp_path / "profile.json", matmul_flops=1e11)
    args, cluster = (workload.state, workload.batch), hetpar.Cluster.virtual(CLUSTER)
    plan = hetpar.make_plan(workload.step, args, cluster, num_microbatches=2,
                            stage_option=hetpar.StageOption(profile=str(tmp_path / "profile.json")))
    assert {s.device_type for s in plan.stages} == {"V100"}  # the A100s, measured slow, are left out
    save_plan(plan, tmp_path / "plan.json")
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    assert "A100 measured (profile), V100 catalog" in capsys.readouterr().out


def test_a_missing_profile_is_named(tmp_path, capsys):
    assert main(["solve", "mlp", "--cluster", "x.yaml", "--profile", str(tmp_path / "none.json")]) == 2
    assert "hetpar profile -o" in capsys.readouterr().err

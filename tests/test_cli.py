"""The command line, driven as a user drives it: a real process, real files."""

import json
import subprocess
import sys

from hetpar.plan.file import PLAN_VERSION
from hetpar.predict.compute import ComputeModel
from hetpar.predict.profile import Profile


def _hetpar(*args, check=True):
    result = subprocess.run([sys.executable, "-m", "hetpar.cli", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, f"hetpar {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result


def test_devices_lists_the_catalog():
    out = _hetpar("devices", "--sources").stdout
    for name in ("H100", "H200", "A100-40GB", "A100-80GB", "V100", "A10", "L4", "RTX4090", "MI250X", "MI300X", "Ascend910B", "Gaudi2", "cpu"):
        assert name in out


def test_profile_writes_a_profile_the_predictor_reads(tmp_path):
    path = tmp_path / "profile.json"
    result = _hetpar("profile", "-o", str(path), "--cpu-devices", "2")
    assert "GFLOP/s" in result.stdout
    raw = json.loads(path.read_text())
    assert raw["devices"]["cpu"]["mesh_size"] == 2 and raw["devices"]["cpu"]["compute"]["matmul_flops"] > 0


def test_profile_calibrates_on_a_models_layers(tmp_path):
    path = tmp_path / "profile.json"
    result = _hetpar("profile", "-o", str(path), "--cpu-devices", "2", "--model", "mlp", "--batch-sizes", "8", "--num-layers", "2",
                     "--mesh-sizes", "1")
    assert "calibrated on" in result.stdout and "on 1 devices" in result.stdout
    cpu = json.loads(path.read_text())["devices"]["cpu"]
    assert cpu["layer_samples"]
    (size, one), = cpu["meshes"]  # the 1-device mesh, calibrated on the layers too
    assert size == 1 and one["calibrated"] and one["matmul_flops"] > 0
    assert Profile.load(path).devices["cpu"].model_for(1) == ComputeModel(**one)


def test_profile_layers_times_each_distinct_layer_of_a_step(tmp_path):
    path = tmp_path / "layers.json"
    result = _hetpar("profile", "-o", str(path), "--cpu-devices", "2", "--layers", "mlp", "--microbatch-sizes", "2,4",
                     "--data-parallel", "1,2", "--rounds", "1", "--no-remat")
    records = Profile.load(path).layers
    assert records and {r.dp for r in records} == {1, 2} and all(r.device_kind == "cpu" for r in records)
    assert all([p.examples for p in r.points] == [2, 4] and r.points[0].forward_s > 0 for r in records)
    assert len({r.signature for r in records}) == len(records) // 2  # each distinct layer once per degree
    assert "layer " in result.stdout


def test_profile_of_an_unknown_model_is_one_clear_line(tmp_path):
    result = _hetpar("profile", "-o", str(tmp_path / "p.json"), "--model", "nosuch", check=False)
    assert result.returncode == 2 and "unknown model 'nosuch'" in result.stderr and "Traceback" not in result.stderr


def test_unknown_command_fails_with_usage():
    result = _hetpar("fly", check=False)
    assert result.returncode != 0 and "invalid choice" in result.stderr


CLUSTER = """\
name: small
groups:
  - name: fast
    device: A100
    nodes: 1
    devices_per_node: 4
  - name: slow
    device: V100
    nodes: 1
    devices_per_node: 4
links:
  - between: [fast, slow]
    bandwidth: 12.5e+9
    latency: 10.0e-6
"""


def _solved(tmp_path, *extra):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    plan = tmp_path / "plan.json"
    result = _hetpar("solve", "mlp", "--cluster", str(cluster), "--batch-size", "16", "--microbatches", "4", "--layers", "4", "-o", str(plan), *extra)
    return plan, result


def test_solve_show_and_simulate_a_plan(tmp_path):
    plan, result = _solved(tmp_path, "--schedule", "1f1b", "--stages", "2")
    assert "wrote" in result.stdout and "predicted step time" in result.stdout
    raw = json.loads(plan.read_text())
    assert raw["version"] == PLAN_VERSION and raw["schedule"] == "1f1b" and len(raw["stages"]) == 2

    shown = _hetpar("show", str(plan)).stdout
    for word in ("A100", "V100", "DP x TP", "memory / capacity", "MFU", "tokens/s", "bubble"):
        assert word in shown

    trace, png = tmp_path / "trace.json", tmp_path / "timeline.png"
    simulated = _hetpar("simulate", str(plan), "--trace", str(trace), "--plot", str(png)).stdout
    assert "simulated step (1f1b, 4 microbatches)" in simulated
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"F0", "B3", "optimizer"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_solve_with_zero_writes_it_into_the_plan(tmp_path):
    plan, result = _solved(tmp_path, "--stages", "2", "--zero", "3")
    stages = json.loads(plan.read_text())["stages"]
    assert [s["zero"] for s in stages if s["gathered"]] and all(s["zero"] in (0, 3) for s in stages)
    assert "ZeRO-3" in result.stdout


def test_solve_with_zero_group_writes_hybrid_sharding(tmp_path):
    """--zero-group: ZeRO over groups of two of each 4-device stage's data axis."""
    plan, result = _solved(tmp_path, "--stages", "2", "--zero", "3", "--zero-group", "2")
    stages = json.loads(plan.read_text())["stages"]
    hybrid = [s for s in stages if s["zero"] == 3 and (s["mesh_shape"] or [len(s["device_ids"])])[0] > 2]
    assert hybrid and all(s["zero_group"] == 2 for s in hybrid)
    assert "gradient shards across replicas" in result.stdout


def test_solve_and_simulate_an_interleaved_plan(tmp_path):
    plan, result = _solved(tmp_path, "--schedule", "interleaved", "--chunks", "2", "--stages", "2")
    raw = json.loads(plan.read_text())
    assert raw["schedule"] == "interleaved" and [s["chunk"] for s in raw["stages"]] == [0, 0, 1, 1]
    assert "2 chunks per device group" in _hetpar("show", str(plan)).stdout
    trace = tmp_path / "trace.json"
    simulated = _hetpar("simulate", str(plan), "--trace", str(trace)).stdout
    assert "simulated step (interleaved, 4 microbatches)" in simulated
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"stage 0", "stage 1"} <= lanes and "stage 2" not in lanes  # one row per device group
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"F0", "F0.1", "B3.1", "B3"}


def test_solve_without_stages_lets_the_planner_choose(tmp_path):
    plan, _ = _solved(tmp_path)
    raw = json.loads(plan.read_text())
    assert raw["bound_ratio"] is not None and raw["bound_ratio"] > 0
    assert sum(s["layer_end"] - s["layer_start"] for s in raw["stages"] if s["replica"] == 0) == 4


def test_validate_shows_a_good_cluster_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    out = _hetpar("validate", str(path)).stdout
    assert "8 devices, valid" in out and "fast <-> slow" in out


def _one_clear_line(result):
    lines = result.stderr.strip().splitlines()
    return result.returncode == 2 and len(lines) == 1 and lines[0].startswith("hetpar: ") and "Traceback" not in result.stderr


def test_bad_cluster_files_fail_with_one_line(tmp_path):
    for broken, message in (
        (CLUSTER.replace("device: V100", "device: V900"), "unknown device type 'V900'"),
        (CLUSTER.replace("nodes: 1\n    devices_per_node: 4\n  - name: slow", "nodes: -2\n    devices_per_node: 4\n  - name: slow"), "nodes"),
    ):
        path = tmp_path / "bad.yaml"
        path.write_text(broken)
        result = _hetpar("validate", str(path), check=False)
        assert _one_clear_line(result) and message in result.stderr


def test_bad_plan_files_fail_with_one_line(tmp_path):
    plan, _ = _solved(tmp_path)
    text = plan.read_text()
    cases = {
        "truncated.json": (text[: len(text) // 2], "cut short"),
        "version.json": (text.replace(f'"version": {PLAN_VERSION}', '"version": 7'), "version 7"),
        "device.json": (text.replace('"device_type": "V100"', '"device_type": "V900"'), "unknown device type"),
        "negative.json": (text.replace('"num_microbatches": 4', '"num_microbatches": -4'), "num_microbatches"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_text(content)
        for command in ("show", "simulate"):
            result = _hetpar(command, str(path), check=False)
            assert _one_clear_line(result) and message in result.stderr, (name, command, result.stderr)


def test_every_command_explains_itself():
    out = _hetpar("--help").stdout
    for command in ("devices", "validate", "profile", "solve", "show", "simulate"):
        assert command in out
        assert "usage: hetpar " + command in _hetpar(command, "--help").stdout


def test_solve_with_replicas_splits_the_batch_by_speed(tmp_path):
    plan, _ = _solved(tmp_path, "--replicas", "2", "--stages", "1", "--microbatches", "2")
    raw = json.loads(plan.read_text())
    assert [s["replica"] for s in raw["stages"]] == [0, 1] and sum(raw["replica_batch"]) == 16
    assert raw["replica_batch"][0] > raw["replica_batch"][1]  # the A100 replica takes more
    png = tmp_path / "replicas.png"
    out = _hetpar("simulate", str(plan), "--plot", str(png)).stdout
    assert "simulated step" in out and png.exists()


def test_solve_compare_prices_manual_configurations_beside_the_planner(tmp_path):
    plan, result = _solved(tmp_path, "--manual", "tp=2,pp=2,dp=1,mb=2,kind=fast",
                           "--manual", "tp=1,pp=2,dp=2,mb=1,schedule=interleaved,chunks=2,remat=full,kind=slow",
                           "--manual", "tp=4,pp=4,dp=4")
    rows = [line for line in result.stdout.splitlines() if line.startswith("│ ")]
    labels = " ".join(line.split("│")[1].strip() for line in rows)
    for label in ("planner", "manual tp2 pp2 dp1 mb2 1f1b on fast", "manual tp1 pp2 dp2 mb1 interleaved x2 remat on slow",
                  "manual tp4 pp4 dp4 mb1 1f1b", "fast alone", "slow alone"):
        assert label in labels, (label, result.stdout)
    text = " ".join(" ".join(line.split()) for line in rows)
    assert "m=8" in text  # 16 examples in microbatches of 1 on 2 replicas (and of 2 on 1)
    assert "needs 64" in text  # the refusal is a row, not a crash
    assert json.loads(plan.read_text())["stages"]  # the planner's plan is still written


def test_solve_refuses_a_bad_manual_configuration_in_one_line(tmp_path):
    result = _hetpar("solve", "mlp", "--cluster", str(tmp_path / "none.yaml"), "--manual", "tp=2,pp=x", check=False)
    assert _one_clear_line(result) and "pp must be a positive whole number" in result.stderr

"""The command line, driven as a user drives it: a real process, real files."""

import json
import subprocess
import sys


def _hetpar(*args, check=True):
    return subprocess.run([sys.executable, "-m", "hetpar.cli", *args], capture_output=True, text=True, check=check, timeout=300)


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
    result = _hetpar("profile", "-o", str(path), "--cpu-devices", "2", "--model", "mlp", "--batch-sizes", "8", "--layers", "2")
    assert "calibrated on" in result.stdout
    assert json.loads(path.read_text())["devices"]["cpu"]["layer_samples"]


def test_profile_of_an_unknown_model_is_one_clear_line(tmp_path):
    result = _hetpar("profile", "-o", str(tmp_path / "p.json"), "--model", "nosuch", check=False)
    assert result.returncode == 2 and "unknown model 'nosuch'" in result.stderr and "Traceback" not in result.stderr


def test_unknown_command_fails_with_usage():
    result = _hetpar("fly", check=False)
    assert result.returncode != 0 and "invalid choice" in result.stderr

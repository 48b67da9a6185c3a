"""Bad input at every boundary, table-driven: each case must be refused with one line
that names the field and the fix (CLI: exit status 2, no traceback; API: a
HetparError subclass), and leave the caller's state as it was.

The CLI is driven in-process (`hetpar.cli.main`) to keep this fast; test_cli.py runs
real processes."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from hetpar.plan import schema as plan_schema
from hetpar.trace.fingerprint import ProgramSignature
from hetpar.cli import main
from hetpar.plan import ClusterGroup, Plan, StagePlan
from hetpar.plan.costs import priced
from hetpar.plan.file import load_plan, plan_to_dict, save_plan
from solver.collectives import LinkCost
from solver.planner import DeviceKind, LayerCost, Problem


def _stage(i: int, devices: tuple[int, ...], layers: tuple[int, int], device_type: str) -> StagePlan:
    return StagePlan(
        index=i, device_type=device_type, device_ids=devices, layer_start=layers[0], layer_end=layers[1],
        layer_names="Dense", flops=1e9, speed_flops=1e13, predicted_time_s=1e-3, group=device_type,
        mesh_shape=(len(devices), 1), forward_s=1e-4, backward_s=2e-4, send_s=1e-5, optimizer_s=1e-5,
        memory_bytes=2**20, memory_capacity=2**34, param_specs=(("params/Dense_0/kernel", ()),),
    )


def _cost_inputs() -> Problem:
    """Four layers on A100s and V100s, as a traced step's would be (per example)."""
    link = LinkCost(2e11, 1e-6)
    kinds = tuple(DeviceKind(name, 4, 4, flops, 2**34, 1.5e12, link, link, peak_flops=flops / 0.7)
                  for name, flops in (("A100", 1e14), ("V100", 1e13)))
    return Problem(tuple(LayerCost(1e9, 3e8, 2**20, 2**16, 2**12) for _ in range(4)), kinds, 16,
                   (("A100", "V100", LinkCost(1e10, 1e-5)),), tokens_per_example=16)


GOOD = priced(Plan(
    stages=(_stage(0, (0, 1, 2, 3), (0, 2), "A100"), _stage(1, (4, 5, 6, 7), (2, 4), "V100")),
    num_microbatches=4, num_layers=4, cluster="4xA100 + 4xV100", schedule="1f1b",
    cluster_groups=(ClusterGroup("A100", "A100", 4), ClusterGroup("V100", "V100", 4)),
    tokens_per_step=256, model_flops=2e9, peak_flops=2e13, cost_inputs=_cost_inputs(),
))


def _edit(change) -> str:
    raw = plan_to_dict(GOOD)
    change(raw)
    return json.dumps(raw)


def _set(path: str, value):
    def change(raw):
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[int(last) if last.isdigit() else last] = value

    return change


def _nested(depth: int) -> str:
    return '{"version": 1, "stages": ' + "[" * depth + "]" * depth + "}"


BAD_PLANS = {
    # name: (file text, words the one line must hold)
    "float microbatches": (_edit(_set("num_microbatches", 4.0)), "num_microbatches"),
    "string microbatches": (_edit(_set("num_microbatches", "4")), "num_microbatches"),
    "zero microbatches": (_edit(_set("num_microbatches", 0)), "num_microbatches"),
    "NaN time": (_edit(_set("stages.0.forward_s", float("nan"))), "stages[0].forward_s"),
    "negative time": (_edit(_set("stages.1.backward_s", -1.0)), "stages[1].backward_s"),
    "string time": (_edit(_set("stages.1.send_s", "fast")), "stages[1].send_s"),
    "negative peak FLOP/s": (_edit(_set("peak_flops", -1e12)), "peak_flops"),
    "stage index out of range": (_edit(_set("stages.1.index", 7)), "index"),
    "device id out of range": (_edit(_set("stages.1.device_ids", [4, 5, 6, 99])), "device position 99"),
    "negative device id": (_edit(_set("stages.0.device_ids", [-1, 1, 2, 3])), "stages[0].device_ids[0]"),
    "mesh shape vs devices": (_edit(_set("stages.0.mesh_shape", [2, 4])), "mesh_shape"),
    "null groups": (_edit(_set("cluster_groups", None)), "cluster_groups"),
    "malformed param_specs": (_edit(_set("stages.0.param_specs", [["params/w"]])), "param_specs"),
    "param_specs of numbers": (_edit(_set("stages.0.param_specs", [[1, 2]])), "param_specs"),
    "unknown field": (_edit(_set("stages.0.colour", "red")), "colour"),
    "unknown schedule": (_edit(_set("schedule", "zigzag")), "schedule"),
    "batch share over 1": (_edit(_set("stages.0.batch_share", 1.5)), "batch_share"),
    "no stages": (_edit(_set("stages", [])), "stages"),
    "not an object": ("[1, 2, 3]", "object"),
    "deep nesting": (_nested(100_000), "plan"),
    "binary garbage": (b"\x89PNG\r\n\x1a\n\x00\xff\xfe garbage", "not valid JSON"),
    "cut short": (json.dumps(plan_to_dict(GOOD))[:200], "not valid JSON"),
    "layers out of order": (_edit(_set("stages.1.layer_start", 3)), "layer"),
}


def _one_line_refusal(capsys, argv: list[str]) -> str:
    status = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("hetpar: "), err
    assert "Traceback" not in err
    return lines[0]


def test_the_good_plan_loads_and_shows(tmp_path, capsys):
    path = tmp_path / "good.json"
    save_plan(GOOD, path)
    assert load_plan(path) == GOOD
    assert main(["show", str(path)]) == 0 and "MFU" in capsys.readouterr().out


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plan_files_are_refused_in_one_line(tmp_path, capsys, case):
    content, words = BAD_PLANS[case]
    path = tmp_path / "bad.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for command in ("show", "simulate"):
        line = _one_line_refusal(capsys, [command, str(path)])
        assert words in line, line
        assert any(w in line for w in ("fix", "solve", "again", "should")), line


def test_the_plan_schema_mirrors_the_plan_dataclasses():
    # A field added to the Plan must be added to hetpar/plan/schema.py (with its range).
    pairs = [(Plan, plan_schema.PlanSchema), (StagePlan, plan_schema.StageSchema),
             (ClusterGroup, plan_schema.ClusterGroupSchema), (ProgramSignature, plan_schema.ProgramSchema)]
    for cls, schema in pairs:
        fields = {f.name for f in dataclasses.fields(cls)}
        assert fields == set(schema.model_fields) - {"version", "estimator_version"}, (cls.__name__, fields ^ set(schema.model_fields))


def test_show_and_simulate_of_ten_million_microbatches_answer_in_seconds(tmp_path, capsys):
    path = tmp_path / "huge.json"
    inputs = dataclasses.replace(GOOD.cost_inputs, batch_size=4 * 10**7)
    save_plan(dataclasses.replace(GOOD, num_microbatches=10**7, cost_inputs=inputs), path)
    start = time.perf_counter()
    assert main(["show", str(path)]) == 0
    assert "predicted step time" in capsys.readouterr().out
    line = _one_line_refusal(capsys, ["simulate", str(path)])
    assert "10000000 microbatches" in line and "closed-form step time" in line and "fewer microbatches" in line
    assert time.perf_counter() - start < 10


# ---- parallelize's arguments -------------------------------------------------------

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hetpar  # noqa: E402


def _step(w, batch):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
    return w - 0.1 * g, loss


import jax  # noqa: E402

VIRTUAL = {"A100": 4, "V100": 4}

BAD_ARGUMENTS = {
    # name: (keyword arguments besides the step, error class, words the message must hold)
    "float microbatches": (dict(num_microbatches=2.0), hetpar.PlanError, "num_microbatches"),
    "string microbatches": (dict(num_microbatches="2"), hetpar.PlanError, "num_microbatches"),
    "None microbatches": (dict(num_microbatches=None), hetpar.PlanError, "num_microbatches"),
    "zero stages": (dict(num_stages=0), hetpar.PlanError, "num_stages"),
    "negative stages": (dict(num_stages=-1), hetpar.PlanError, "num_stages"),
    "fractional stages": (dict(num_stages=1.5), hetpar.PlanError, "num_stages"),
    "negative layers": (dict(num_layers=-2), hetpar.PlanError, "num_layers"),
    "negative mesh": (dict(mesh_shape=(-2, -4)), hetpar.PlanError, "mesh_shape"),
    "bool replicas": (dict(num_replicas=True), hetpar.PlanError, "num_replicas"),
    "negative batch_argnum": (dict(batch_argnum=-1), hetpar.PlanError, "batch_argnum"),
    "unknown runtime": (dict(runtime="mpi"), hetpar.PlanError, "runtime"),
    "dict cluster": (dict(cluster={"A100": 8}), hetpar.HetparError, "Cluster.virtual"),
    "missing cluster file": (dict(cluster="/no/such/cluster.yaml"), hetpar.ClusterError, "cannot read cluster file"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_parallelize_arguments_fail_at_parallelize(case):
    kwargs, error, words = BAD_ARGUMENTS[case]
    kwargs = {"cluster": hetpar.Cluster.virtual(VIRTUAL), **kwargs}
    with pytest.raises(error) as info:
        hetpar.parallelize(_step, **kwargs)
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_bad_clusters_and_steps_are_named():
    with pytest.raises(hetpar.ClusterError, match="non-empty mapping"):
        hetpar.Cluster.virtual({})
    with pytest.raises(hetpar.ClusterError, match="non-empty mapping.*'A100'"):
        hetpar.Cluster.virtual("A100")
    with pytest.raises(hetpar.HetparError, match="train step as a function"):
        hetpar.parallelize(42, cluster=hetpar.Cluster.virtual(VIRTUAL))
    with pytest.raises(hetpar.HetparError, match="train step as a function"):
        hetpar.parallelize(cluster=hetpar.Cluster.virtual(VIRTUAL))("not a step")


def test_numpy_counts_and_a_cluster_path_are_accepted(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("groups:\n  - {name: a, device: A100, nodes: 1, devices_per_node: 8}\n")
    w, batch = jnp.ones((8, 4)), {"x": jnp.ones((16, 8))}
    before = np.asarray(w).copy()
    step = hetpar.parallelize(_step, cluster=str(path), num_microbatches=np.int64(2), num_stages=np.int32(2))
    new_w, loss = step(w, batch)
    ref_w, ref_loss = jax.jit(_step)(w, batch)
    assert isinstance(loss, jax.Array)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new_w), np.asarray(ref_w), rtol=1e-5, atol=1e-6)
    assert step.plan.num_stages == 2 and step.plan.num_microbatches == 2
    np.testing.assert_array_equal(np.asarray(w), before)  # the caller's state is untouched


# ---- cluster files ------------------------------------------------------------------

CLUSTER = """\
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

BAD_CLUSTERS = {
    "NaN bandwidth": (CLUSTER.replace("12.5e+9", "nan"), "line 12: link bandwidth must be a finite number"),
    "inf latency": (CLUSTER.replace("10.0e-6", "inf"), "line 13: link latency must be a finite number"),
    "negative latency": (CLUSTER.replace("10.0e-6", "-1e-6"), "latency must not be negative"),
    "duplicate key": (CLUSTER.replace("    nodes: 1\n    devices_per_node: 4\n  - name: slow",
                                      "    nodes: 1\n    nodes: 2\n    devices_per_node: 4\n  - name: slow"), "key 'nodes' twice"),
    "duplicate link": (CLUSTER + "  - between: [slow, fast]\n    bandwidth: 1e9\n    latency: 1e-6\n", "second link"),
    "complex key": (CLUSTER.replace("  - name: slow", "  - [a, b]: slow\n    name: slow"), "plain names"),
    "binary garbage": (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not a text (UTF-8) file"),
    "absurd size": (CLUSTER.replace("devices_per_node: 4\n  - name: slow", "devices_per_node: 1000000000000\n  - name: slow"),
                    "devices_per_node must be at most"),
    "fractional nodes": (CLUSTER.replace("nodes: 1\n    devices_per_node: 4\n  - name: slow",
                                         "nodes: 1.5\n    devices_per_node: 4\n  - name: slow"), "nodes must be an integer"),
    "empty file": ("", "empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_CLUSTERS))
def test_bad_cluster_files_are_refused_in_one_line(tmp_path, capsys, case):
    content, words = BAD_CLUSTERS[case]
    path = tmp_path / "cluster.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = _one_line_refusal(capsys, ["validate", str(path)])
    assert words in line, line
    with pytest.raises(hetpar.ClusterError):
        hetpar.Cluster.from_file(str(path))


def test_the_good_cluster_file_validates(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    assert main(["validate", str(path)]) == 0 and "8 devices, valid" in capsys.readouterr().out


# ---- command-line options -----------------------------------------------------------

BAD_OPTIONS = {
    # name: (argv after the command's required arguments, words the one line must hold)
    "zero microbatches": (["solve", "mlp", "--microbatches", "0"], "--microbatches"),
    "negative microbatches": (["solve", "mlp", "--microbatches", "-1"], "--microbatches"),
    "negative batch size": (["solve", "mlp", "--batch-size", "-4"], "--batch-size"),
    "negative layers": (["solve", "mlp", "--layers", "-1"], "--layers"),
    "zero layers": (["solve", "mlp", "--layers", "0"], "--layers"),
    "zero stages": (["solve", "mlp", "--stages", "0"], "--stages"),
    "zero replicas": (["solve", "mlp", "--replicas", "0"], "--replicas"),
    "negative batch argnum": (["solve", "mlp", "--batch-argnum", "-1"], "--batch-argnum"),
    "output into a missing directory": (["solve", "mlp", "-o", "/no/such/dir/plan.json"], "-o/--output"),
    "function spec ':'": (["solve", ":"], "names no function"),
    "function spec not callable": (["solve", "solver.pipeline_sim:MAX_SIMULATED_MICROBATCHES"], "not a function"),
    "negative mesh size": (["profile", "--mesh-size", "-1"], "--mesh-size"),
    "unknown device type": (["profile", "--device-type", "NoSuchGPU"], "--device-type"),
    "mesh sizes beyond the devices": (["profile", "--mesh-sizes", "2,64"], "mesh of 64 devices"),
    "mesh sizes not numbers": (["profile", "--mesh-sizes", "2,four"], "--mesh-sizes"),
    "trace into a missing directory": (["simulate", "PLAN", "--trace", "/no/such/dir/t.json"], "--trace"),
    "trace with a wrong extension": (["simulate", "PLAN", "--trace", "TMP/t.png"], "--trace: must end in .json"),
    "plot with a wrong extension": (["simulate", "PLAN", "--plot", "TMP/t.json"], "--plot: must end in .png"),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_command_line_options_are_refused_in_one_line(tmp_path, capsys, case):
    argv, words = BAD_OPTIONS[case]
    cluster, plan = tmp_path / "cluster.yaml", tmp_path / "plan.json"
    cluster.write_text(CLUSTER)
    save_plan(GOOD, plan)
    argv = [a.replace("PLAN", str(plan)).replace("TMP", str(tmp_path)) for a in argv]
    if argv[0] == "solve":
        argv += ["--cluster", str(cluster)] + ([] if "-o" in argv else ["-o", str(tmp_path / "out.json")])
    line = _one_line_refusal(capsys, argv)
    assert words in line, line
    assert not (tmp_path / "out.json").exists()


def test_an_empty_cluster_and_a_step_with_no_outputs_are_named():
    from hetpar.cluster.cluster import Cluster

    with pytest.raises(hetpar.ClusterError, match="the cluster has no devices"):
        Cluster(())
    step = hetpar.parallelize(lambda w, batch: None, cluster=hetpar.Cluster.virtual(VIRTUAL))
    with pytest.raises(hetpar.UnsupportedStepError, match="returns no arrays.*return them"):
        step(jnp.ones((8, 4)), {"x": jnp.ones((16, 8))})

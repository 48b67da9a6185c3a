"""Host offload: a stage's optimizer state kept in host memory (JAX's `pinned_host`
memory kind) between steps, moved to its devices for the update. Parity with one
device with it forced (one and two stages, with and without ZeRO), the plan
field's round trip, where the arrays really live, and the planner offloading only
where device memory alone does not hold the model."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import pytest

import hetpar
from hetpar.errors import PlanError
from hetpar.options import ShardingOption, StageOption
from hetpar.plan.file import load_plan, save_plan
from hetpar.cluster.cluster import Cluster
from hetpar.pipeline import layers_pass
from hetpar.plan.auto import SearchOptions, problem_for, search
from hetpar.plan.costs import estimate_plan
from hetpar.trace.traced_step import trace_step
from models import llama, mlp
from solver.cost.stage_costs import StageConfig, StageCosts
from parity import run_parity

TWO_TYPES = {"A100": 4, "V100": 4}
HOST = StageOption(mode="uniform", offload="host")


def _mlp():
    return mlp.setup(batch_size=16, hidden=32, depth=3)  # Adam (adamw), as every reference model


def _kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree) if getattr(leaf, "ndim", 0) >= 1}


@pytest.mark.parametrize("stages, zero", [(1, 0), (2, 0), (2, 1), (2, 3)])
def test_offload_parity(stages, zero):
    cluster = hetpar.Cluster.virtual({"A100": 4} if stages == 1 else TWO_TYPES)
    plan = run_parity(_mlp(), cluster, steps=2, num_stages=stages, num_layers=4, num_microbatches=2, stage_option=HOST,
                      sharding_option=ShardingOption(zero=zero))
    for stage in plan.stages:
        assert stage.offload == "host" and stage.offloaded and stage.zero == zero
        assert stage.host_bytes > 0


def test_offload_parity_with_recomputation_and_replicas():
    """Offload beside 1F1B with full recomputation, and on two data-parallel replicas
    (the update runs once, on replica 0's stages, from the combined gradients)."""
    run_parity(_mlp(), hetpar.Cluster.virtual(TWO_TYPES), steps=2, num_stages=2, num_layers=4, num_microbatches=4,
               schedule="1f1b", stage_option=StageOption(mode="uniform", offload="host", remat="full"))
    plan = run_parity(_mlp(), hetpar.Cluster.virtual(TWO_TYPES), steps=2, num_replicas=2, num_microbatches=2,
                      stage_option=StageOption(offload="host"))
    assert plan.num_replicas == 2 and all(s.offload == "host" for s in plan.stages)


def test_offloaded_state_lives_in_host_memory():
    """After a step, the optimizer state the step returns lies in `pinned_host` memory
    and the parameters on the devices; a second step reads it from there."""
    workload = _mlp()
    par = hetpar.parallelize(workload.step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, num_layers=4,
                             num_microbatches=2, stage_option=HOST)
    state, _ = par(workload.state, workload.batch)
    adam = state.opt_state[0]
    assert _kinds((adam.mu, adam.nu)) == {"pinned_host"}
    assert _kinds(state.params) == {"device"}
    state, loss = par(state, workload.batch)
    assert _kinds((state.opt_state[0].mu, state.opt_state[0].nu)) == {"pinned_host"} and float(loss) > 0


def _saved_host_plan(workload, tmp_path):
    """A two-stage plan with both stages' optimizer state on the host, and its file."""
    plan = hetpar.make_plan(workload.step, (workload.state, workload.batch), hetpar.Cluster.virtual(TWO_TYPES),
                            num_stages=2, num_layers=4, num_microbatches=2, stage_option=HOST)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    return plan, path


def test_offload_plan_round_trip(tmp_path):
    workload = _mlp()
    plan, path = _saved_host_plan(workload, tmp_path)
    loaded = load_plan(path)
    assert [s.offload for s in loaded.stages] == ["host", "host"]
    assert [s.offloaded for s in loaded.stages] == [s.offloaded for s in plan.stages] and all(s.offloaded for s in loaded.stages)
    assert [s.host_bytes for s in loaded.stages] == [s.host_bytes for s in plan.stages]
    # the saved plan runs as it was solved: its state in host memory
    par = hetpar.parallelize(workload.step, plan=path)
    state, _ = par(workload.state, workload.batch)
    assert _kinds(state.opt_state[0].mu) == {"pinned_host"}


def test_offload_plan_fields_are_checked(tmp_path):
    workload = _mlp()
    plan, path = _saved_host_plan(workload, tmp_path)
    text = path.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text(text.replace('"offload": "host"', '"offload": "disk"', 1))
    with pytest.raises(PlanError, match="offload"):
        load_plan(bad)
    bad.write_text(text.replace('"offload": "host"', '"offload": ""', 1))
    with pytest.raises(PlanError, match="offloaded"):
        load_plan(bad)


def test_offload_option_is_checked():
    workload = _mlp()
    with pytest.raises(PlanError, match="StageOption.offload"):
        hetpar.make_plan(workload.step, (workload.state, workload.batch), hetpar.Cluster.virtual({"cpu": 2}),
                         stage_option=StageOption(offload="disk"))


def test_planner_keeps_state_on_devices_when_it_fits():
    """The planner offloads only where memory asks: a small model on devices with
    room to spare keeps its optimizer state on them (this machine's host memory is
    known, so offload was open to it)."""
    workload = _mlp()
    cluster = hetpar.Cluster.virtual(TWO_TYPES)
    assert all(g.host_memory_bytes > 0 for g in cluster.groups)
    plan = hetpar.make_plan(workload.step, (workload.state, workload.batch), cluster, num_microbatches=2)
    assert all(s.offload == "" and not s.offloaded and s.host_bytes == 0 for s in plan.stages)


CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
SEQ = 1024  # Llama-2-7B's shapes at 1,024 tokens a sequence: the activations of one sequence fit a 16 GB V100 stage


@pytest.fixture(scope="module")
def llama_7b():
    config = replace(llama.LLAMA2_7B, seq_len=SEQ)
    w = llama.setup(64, config, abstract=True)  # jax.eval_shape: nothing is allocated
    return trace_step(w.step, (w.state, w.batch), 1, 1)


def _search(traced, cluster: Cluster, **options):
    layers = layers_pass(traced, cluster, StageOption(), True)
    return layers, search(layers, cluster, 64, SEQ, SearchOptions(**options))


def test_7b_offloads_where_device_memory_alone_is_too_small(llama_7b):
    """Six 16 GB V100s hold 81 GiB, less than the 100 GiB of a 7B model's parameters,
    gradients and Adam state: without offload no plan fits; with the optimizer state
    in the node's host memory one does, and its step time includes moving that state
    to the devices and back over the host link every step."""
    cluster = Cluster.from_file(str(CLUSTERS / "v100_offload_6.yaml")).numbered()
    with pytest.raises(PlanError, match="no plan fits"):
        _search(llama_7b, cluster, offload_tiers=("",))
    layers, (plan, result) = _search(llama_7b, cluster)
    assert all(s.offload == "host" for s in plan.stages)
    inputs = problem_for(layers, cluster, 64, SEQ, SearchOptions())
    cost = estimate_plan(replace(plan, cost_inputs=inputs))
    assert cost.fits and all(c.group_host_bytes > 0 and c.fits_host for c in cost.stages)
    # The same decisions without offload: the devices overflow, and the step is faster by the transfers.
    on_device = estimate_plan(replace(plan, cost_inputs=inputs, stages=tuple(replace(s, offload="") for s in plan.stages)))
    assert not on_device.fits
    costs = StageCosts(inputs)
    for s, c, d in zip(plan.stages, cost.stages, on_device.stages):
        cfg = StageConfig(s.group, s.data_parallel, s.tensor_parallel)
        transfer = costs.offload.host_transfer_s(cfg, d.memory.optimizer_state)
        assert c.optimizer_s == pytest.approx(d.optimizer_s + transfer, rel=1e-9) and transfer > 0.1
        assert c.memory.optimizer_state == 0 and c.memory.host == pytest.approx(d.memory.optimizer_state)
    assert cost.step_s > on_device.step_s


def _node_of_8(tmp_path, device: str) -> Cluster:
    text = (CLUSTERS / "v100_offload_6.yaml").read_text().replace("V100-16GB", device)
    path = tmp_path / f"{device}_8.yaml"
    path.write_text(text.replace("devices_per_node: 6", "devices_per_node: 8"))
    return Cluster.from_file(str(path)).numbered()


def test_7b_offloads_only_where_needed_or_faster(llama_7b, tmp_path):
    """A node of 80 GB H100s holds everything: no stage offloads. A node of 32 GB
    V100s holds everything too, but only with more microbatches (less memory each);
    offloading the optimizer state instead moves it once a step: where the planner
    takes that, the estimator rates it faster than the best plan keeping the state on
    the devices."""
    _, (plan, _) = _search(llama_7b, _node_of_8(tmp_path, "H100"))
    assert all(s.offload == "" for s in plan.stages)
    cluster = _node_of_8(tmp_path, "V100")
    _, (plan, result) = _search(llama_7b, cluster)
    _, (_, kept) = _search(llama_7b, cluster, offload_tiers=("",))
    if any(s.offload for s in plan.stages):
        assert result.best.step_s < kept.best.step_s
    else:
        assert result.best.step_s == pytest.approx(kept.best.step_s)


def solve_and_show(tmp_path, group_fields: str, offload: str, columns: int) -> tuple:
    """`hetpar solve --offload OFFLOAD` of the MLP in two stages on one node of 4 A100s
    (with `group_fields` added to its group), then `hetpar show` of the plan: the plan
    as loaded back, and what `show` printed."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("name: small\ngroups:\n  - name: fast\n    device: A100\n    nodes: 1\n    devices_per_node: 4\n"
                       + group_fields)
    plan = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "hetpar.cli", "solve", "mlp", "--cluster", str(cluster), "--batch-size", "16",
                          "--microbatches", "2", "--stages", "2", "--layers", "4", "--offload", offload, "-o", str(plan)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    shown = subprocess.run([sys.executable, "-m", "hetpar.cli", "show", str(plan)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "COLUMNS": str(columns)}).stdout
    return load_plan(plan), shown


def test_cli_solve_offload_and_show_host_bytes(tmp_path):
    """`hetpar solve --offload host` on a cluster file with host memory: every stage
    keeps its optimizer state in host memory, and `hetpar show` prints each stage's
    device and host bytes."""
    loaded, shown = solve_and_show(tmp_path, "    host_memory_gib: 256\n", "host", 250)
    assert all(s.offload == "host" and s.offloaded and s.host_bytes > 0 for s in loaded.stages)
    assert "host memory" in shown and "memory / capacity" in shown
    for s in loaded.stages:
        assert f"{s.host_bytes / 2**20:.1f} MiB (host)" in shown


def test_offload_beyond_host_memory_is_refused_with_the_numbers(tmp_path):
    """Forced offload onto a node whose host memory (from the cluster file) is too
    small for the state: placement names the stage, the bytes and the fix; a cluster
    file's host memory must be positive."""
    workload = _mlp()
    path = tmp_path / "cluster.yaml"
    text = "name: small\ngroups:\n  - name: fast\n    device: A100\n    nodes: 1\n    devices_per_node: 2\n    host_memory_gib: {}\n"
    path.write_text(text.format("1.0e-6"))  # 1 KiB of host memory per node: 0.000512 MiB for each of its 2 devices
    with pytest.raises(PlanError, match=r"does not fit in host memory: stage 0 keeps [\d.]+ MiB .* is 0.000512 MiB; to fit: more host memory \(host_memory_gib\)"):
        hetpar.make_plan(workload.step, (workload.state, workload.batch), Cluster.from_file(str(path)).numbered(),
                         num_stages=1, num_microbatches=2, stage_option=StageOption(offload="host"))
    path.write_text(text.format("-4"))
    with pytest.raises(hetpar.errors.ClusterError, match="host_memory_gib must be positive"):
        Cluster.from_file(str(path))

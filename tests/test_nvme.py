"""The NVMe tier: a stage's optimizer state kept in a file store on a local disk
between steps (hetpar/runtime/nvme_store.py, nvme_tier.py), read through host memory
for the update and written back as a new generation. Parity with one device with it
forced (one and two stages: the state really round-trips through the files), crash
safety (a step or a process that dies mid-write leaves the previous generation the
one a reader gets, valid), handles in the returned state that `hetpar.gather`,
checkpoints and numpy read, and its price (disk bandwidth in the step time, disk
bytes counted apart from host and device memory, the planner going to disk only where
host memory is short)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest

import hetpar
from hetpar.cluster.cluster import Cluster
from hetpar.errors import PlanError
from hetpar.options import RuntimeOption, ShardingOption, StageOption
from hetpar.plan.auto import SearchOptions, problem_for
from hetpar.plan.costs import estimate_plan
from hetpar.runtime import nvme_store
from hetpar.runtime.nvme_store import NvmeArray, NvmeStateError, NvmeStore
from models import mlp
from parity import assert_close, run_parity, with_grads
from test_offload import SEQ, _search, llama_7b, solve_and_show  # noqa: F401  (llama_7b: a fixture)
from solver.cost.stage_costs import StageConfig, StageCosts

TWO_TYPES = {"A100": 4, "V100": 4}
NVME = StageOption(mode="uniform", offload="nvme")
CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"


def _mlp():
    return mlp.setup(batch_size=16, hidden=32, depth=3)  # Adam (adamw), as every reference model


def _adam(state):
    return state.opt_state[0]


# --- parity: the state round-trips through the files ----------------------------------------


@pytest.mark.parametrize("stages, zero", [(1, 0), (2, 0), (2, 1)])
def test_nvme_parity(stages, zero, tmp_path):
    """Three steps, each reading the optimizer state the last one wrote to disk:
    loss, gradients, parameters and optimizer state as jax.jit's on one device. Under
    ZeRO-1 each device's shard is written and read by itself."""
    cluster = hetpar.Cluster.virtual({"A100": 4} if stages == 1 else TWO_TYPES)
    plan = run_parity(_mlp(), cluster, steps=3, num_stages=stages, num_layers=4, num_microbatches=2, stage_option=NVME,
                      sharding_option=ShardingOption(zero=zero), runtime_option=RuntimeOption(nvme_dir=str(tmp_path / "store")))
    for stage in plan.stages:
        assert stage.offload == "nvme" and stage.offloaded and stage.zero == zero
        assert stage.nvme_bytes > 0 and stage.host_bytes > 0  # the state on disk; host memory stages one layer's share
    store = NvmeStore(tmp_path / "store")
    assert store.generation == 3  # one generation a step
    assert sorted(p.name for p in (tmp_path / "store").glob("gen-*")) == ["gen-00000002.bin", "gen-00000003.bin"]


def test_nvme_parity_on_two_replicas(tmp_path):
    """Two data-parallel pipelines: the update runs once, on replica 0's stages, and
    only their new state goes to disk."""
    plan = run_parity(_mlp(), hetpar.Cluster.virtual(TWO_TYPES), steps=2, num_replicas=2, num_microbatches=2,
                      stage_option=StageOption(offload="nvme"), runtime_option=RuntimeOption(nvme_dir=str(tmp_path)))
    assert plan.num_replicas == 2 and all(s.offload == "nvme" for s in plan.stages)
    assert NvmeStore(tmp_path).generation == 2


def test_state_between_steps_is_on_disk_not_in_memory(tmp_path):
    """The returned state's Adam moments are handles (no bytes) to files of the newest
    generation; the parameters stay arrays on the devices. numpy, hetpar.gather and a
    checkpoint read the handles' files."""
    w = _mlp()
    par = hetpar.parallelize(w.step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, num_layers=4,
                             num_microbatches=2, stage_option=NVME, runtime_option=RuntimeOption(nvme_dir=str(tmp_path / "s")))
    state, _ = par(w.state, w.batch)
    moments = jax.tree.leaves((_adam(state).mu, _adam(state).nu))
    assert moments and all(isinstance(x, NvmeArray) and x.generation == 1 for x in moments)
    assert all(isinstance(x, jax.Array) and x.sharding.memory_kind == "device" for x in jax.tree.leaves(state.params))
    assert sorted(x.key for x in moments) == sorted(par.nvme_store.handles())  # the whole generation, nothing else
    assert sum(x.nbytes for x in moments) <= os.path.getsize(tmp_path / "s" / "gen-00000001.bin") \
        <= sum(x.nbytes + 64 for x in moments)  # one file, each array at a 64-byte boundary
    reference = jax.jit(w.step)(w.state, w.batch)[0]
    assert_close(_adam(hetpar.gather(state)).mu, _adam(reference).mu, "gathered moments")
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(_adam(hetpar.gather(state))))
    hetpar.save_checkpoint(tmp_path / "ckpt", state)
    restored = hetpar.restore_checkpoint(tmp_path / "ckpt", reference)
    assert_close(_adam(restored).nu, _adam(reference).nu, "restored moments")
    with pytest.raises(TypeError):
        moments[0] + 1  # JAX operations need the handle read first (np.asarray)


# --- crash safety -------------------------------------------------------------------------------


def _dying_after(n: int, monkeypatch, how=None):
    """Makes the store's array writer fail (or `how`) after `n` arrays were written."""
    real, written = nvme_store._write_array, []

    def write(*args):
        if len(written) == n:
            (how or _raise)()
        written.append(args)
        return real(*args)

    monkeypatch.setattr(nvme_store, "_write_array", write)


def _raise():
    raise OSError("disk died mid-write")


def test_write_that_dies_leaves_the_previous_generation(tmp_path, monkeypatch):
    store = NvmeStore(tmp_path)
    first = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.full((4,), 7, np.int32)}
    handles = store.write(first)
    _dying_after(1, monkeypatch)
    with pytest.raises(OSError, match="mid-write"):
        store.write({"a": first["a"] + 100, "b": first["b"] + 100})
    assert (tmp_path / "gen-00000002.bin").exists()  # half a generation is on disk...
    assert store.generation == 1  # ...and the manifest does not name it
    for key, value in first.items():
        np.testing.assert_array_equal(handles[key].read(), value)
        np.testing.assert_array_equal(store.handles()[key].read(), value)
    monkeypatch.undo()
    again = store.write({"a": first["a"] + 1, "b": first["b"] + 1})  # the next write replaces the half one
    assert again["a"].generation == 2
    np.testing.assert_array_equal(again["b"].read(), first["b"] + 1)
    np.testing.assert_array_equal(handles["a"].read(), first["a"])  # the previous generation is kept


def test_process_killed_mid_write_resumes_from_the_previous_generation(tmp_path):
    """A process that dies (os._exit: no cleanup, no exception handlers) while writing
    generation 2: a new process reads generation 1, valid."""
    child = textwrap.dedent(f"""
        import os, numpy as np
        from hetpar.runtime import nvme_store
        store = nvme_store.NvmeStore({str(tmp_path)!r})
        store.write({{"x": np.arange(1000, dtype=np.float32), "y": np.ones((10, 10))}})
        real = nvme_store._write_array
        def dying(*args):
            real(*args)
            os._exit(9)  # killed after one file of the new generation is on disk
        nvme_store._write_array = dying
        store.write({{"x": np.zeros(1000, dtype=np.float32), "y": np.zeros((10, 10))}})
    """)
    run = subprocess.run([sys.executable, "-c", child], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 9, run.stderr[-2000:]
    store = NvmeStore(tmp_path)
    assert store.generation == 1 and (tmp_path / "gen-00000002.bin").exists()
    state = store.handles()
    np.testing.assert_array_equal(np.asarray(state["x"]), np.arange(1000, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(state["y"]), np.ones((10, 10)))


def test_step_that_dies_mid_write_can_be_run_again(tmp_path, monkeypatch):
    """The third step's write fails: the call raises, the state the second step
    returned still reads as it was, and running the third step again from it gives
    jax.jit's third step."""
    w = _mlp()
    step = with_grads(w.loss_fn)
    par = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, num_layers=4, num_microbatches=2,
                             stage_option=NVME, runtime_option=RuntimeOption(nvme_dir=str(tmp_path)))
    ref, state = w.state, w.state
    for _ in range(2):
        ref = jax.jit(step)(ref, w.batch)[0]
        state = par(state, w.batch)[0]
    _dying_after(3, monkeypatch)
    with pytest.raises(OSError, match="mid-write"):
        par(state, w.batch)
    assert par.nvme_store.generation == 2
    assert_close(state.opt_state, ref.opt_state, "state of step 2 after step 3 died")
    monkeypatch.undo()
    ref, ref_loss, _ = jax.jit(step)(ref, w.batch)
    state, loss, _ = par(state, w.batch)
    assert_close(loss, ref_loss, "loss of step 3, run again")
    assert_close(state.opt_state, ref.opt_state, "state of step 3, run again")
    assert_close(state.params, ref.params, "parameters of step 3, run again")


def test_damaged_or_superseded_state_is_refused(tmp_path):
    store = NvmeStore(tmp_path)
    old = store.write({"a": np.arange(8.0)})["a"]
    store.write({"a": np.arange(8.0) + 1})
    new = store.write({"a": np.arange(8.0) + 2})["a"]
    with pytest.raises(NvmeStateError, match="generation 1 .* not committed .* the state the latest step returned"):
        old.read()
    with open(tmp_path / "gen-00000003.bin", "r+b") as f:  # a bit flipped after the commit
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(NvmeStateError, match="checksum"):
        new.read()


def test_store_reads_and_writes_shards(tmp_path):
    """A sharded array is written shard by shard and read back into any layout, memory
    kind included; bfloat16 and scalars round-trip."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), sharding)
    handles = NvmeStore(tmp_path).write({"x": x, "h": np.ones((3,), jax.numpy.bfloat16), "s": np.float32(2.5)})
    host = sharding.with_memory_kind("pinned_host")
    back = handles["x"].load(host)
    assert back.sharding == host
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    assert handles["h"].read().dtype == jax.numpy.bfloat16 and float(handles["s"].read()) == 2.5


# --- pricing and planning -------------------------------------------------------------------------

def test_7b_goes_to_nvme_only_where_host_memory_is_short(llama_7b, tmp_path):
    """Six 16 GB V100s with 32 GiB of host memory: the Adam state fits neither the
    devices nor host memory, so without the disk no plan fits; with it the state goes
    to the NVMe tier, counted on disk apart from device and host memory, and the step
    time adds reading and writing it at the disk's bandwidth to the host link's time.
    The same node with 512 GiB of host memory keeps the state there instead."""
    path = CLUSTERS / "v100_nvme_6.yaml"
    cluster = Cluster.from_file(str(path)).numbered()
    with pytest.raises(PlanError, match="no plan fits.*allow offload='nvme'"):
        _search(llama_7b, cluster, offload_tiers=("", "host"))
    without_disk = tmp_path / "no_disk.yaml"
    without_disk.write_text("\n".join(line for line in path.read_text().splitlines() if "nvme_gib" not in line))
    with pytest.raises(PlanError, match="no plan fits.*give nvme_gib in the cluster file's groups"):
        _search(llama_7b, Cluster.from_file(str(without_disk)).numbered())
    layers, (plan, _) = _search(llama_7b, cluster)
    assert all(s.offload == "nvme" for s in plan.stages)
    inputs = problem_for(layers, cluster, 64, SEQ, SearchOptions())
    cost = estimate_plan(replace(plan, cost_inputs=inputs))
    assert cost.fits and all(c.group_nvme_bytes > 0 and c.fits_nvme and c.fits_host for c in cost.stages)
    on_host = estimate_plan(replace(plan, cost_inputs=inputs, stages=tuple(replace(s, offload="host") for s in plan.stages)))
    on_device = estimate_plan(replace(plan, cost_inputs=inputs, stages=tuple(replace(s, offload="") for s in plan.stages)))
    assert not on_host.fits and all(not c.fits_host for c in on_host.stages) and not on_device.fits
    costs = StageCosts(inputs)
    for s, c, h, d in zip(plan.stages, cost.stages, on_host.stages, on_device.stages):
        cfg = StageConfig(s.group, s.data_parallel, s.tensor_parallel)
        state = d.memory.optimizer_state
        disk = costs.offload.nvme_transfer_s(cfg, state)
        kind = inputs.kind(s.group)
        assert disk == pytest.approx(2 * state / (kind.nvme_bandwidth / min(cfg.devices, kind.devices_per_node)))
        assert c.optimizer_s == pytest.approx(h.optimizer_s + disk, rel=1e-9) and disk > 1.0
        assert c.memory.optimizer_state == 0 and c.memory.nvme == pytest.approx(state)  # on disk, apart
        # host memory stages the largest layer's share (what the devices stream at once), in and out
        assert c.memory.host == pytest.approx(2 * (h.memory.workspace - d.memory.workspace)) and 0 < c.memory.host < h.memory.host / 2
        assert c.memory.total == pytest.approx(h.memory.total)  # the devices hold the same either way
    assert cost.step_s > on_host.step_s
    roomy = tmp_path / "roomy.yaml"
    roomy.write_text(path.read_text().replace("host_memory_gib: 32 ", "host_memory_gib: 512 "))
    _, (plan, _) = _search(llama_7b, Cluster.from_file(str(roomy)).numbered())
    assert all(s.offload == "host" for s in plan.stages)


def test_nvme_fields_in_cluster_files(tmp_path):
    path = tmp_path / "c.yaml"
    text = "name: n\ngroups:\n  - name: g\n    device: A100\n    nodes: 1\n    devices_per_node: 4\n    nvme_gib: {}\n    nvme_gib_s: 2\n"
    path.write_text(text.format(100))
    group = Cluster.from_file(str(path)).groups[0]
    assert group.nvme_bytes == 100 * 2**30 and group.nvme_bandwidth == 2 * 2**30
    path.write_text(text.format(-1))
    with pytest.raises(hetpar.errors.ClusterError, match="nvme_gib must be positive"):
        Cluster.from_file(str(path))


def test_nvme_beyond_the_disk_is_refused_with_the_numbers(tmp_path):
    w = _mlp()
    path = tmp_path / "cluster.yaml"
    path.write_text("name: small\ngroups:\n  - name: fast\n    device: A100\n    nodes: 1\n    devices_per_node: 2\n"
                    "    host_memory_gib: 64\n    nvme_gib: 1.0e-6\n")
    with pytest.raises(PlanError, match=r"does not fit in its nodes' disks .*: stage 0 keeps [\d.]+ MiB .* on its node's disk, and each A100's share of it is 0.000512 MiB; to fit: a larger disk \(nvme_gib\)"):
        hetpar.make_plan(w.step, (w.state, w.batch), Cluster.from_file(str(path)).numbered(), num_stages=1,
                         num_microbatches=2, stage_option=StageOption(offload="nvme"))


def test_cli_solve_offload_nvme_and_show(tmp_path):
    """`hetpar solve --offload nvme`: every stage keeps its state on disk; `hetpar
    show` prints the tier, the host staging and the disk bytes per stage."""
    loaded, shown = solve_and_show(tmp_path, "    host_memory_gib: 256\n    nvme_gib: 1000\n", "nvme", 320)
    assert all(s.offload == "nvme" and s.offloaded and s.nvme_bytes > 0 for s in loaded.stages)
    for s in loaded.stages:
        assert f"(nvme {s.nvme_bytes / 2**20:.1f} MiB)" in shown, shown

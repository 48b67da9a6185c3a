"""Run by every process of a `hetpar launch` job in tests/test_distributed.py: the
checks named on the command line, each against `jax.jit(step)` on one local device.
Process 0 prints `CHECK <name> ok` after each; any failure raises (and fails the launch)."""

from __future__ import annotations

import sys
from typing import Any

import hetpar
from hetpar.runtime import distributed

distributed.initialize()
import faulthandler  # noqa: E402

faulthandler.dump_traceback_later(int(__import__("os").environ.get("HETPAR_TEST_DUMP_S", "240")), exit=True)  # a hang shows where each process was
print(f"PID {__import__('os').getpid()}", flush=True)

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import models  # noqa: E402
from parity import assert_close, with_grads  # noqa: E402


def workload(batch_size: int = 8):
    return models.get("mlp", batch_size=batch_size)


def reference(w, steps: int):
    """jax.jit on this process's first device: the numbers every plan must give."""
    device = jax.local_devices()[0]
    step = jax.jit(with_grads(w.loss_fn))
    state, batch = jax.device_put((w.state, w.batch), device)
    out = []
    for _ in range(steps):
        state, loss, grads = step(state, batch)
        out.append(jax.device_get((state.params, state.opt_state, loss, grads)))
    return out


def compare(parallel, w, steps: int, name: str, resident_from: int = 1) -> Any:
    """`steps` steps of `parallel` against jax.jit; from step `resident_from` on, no
    array may leave the devices for the host during the step (state stays resident).
    Returns the last state."""
    expected = reference(w, steps)
    state = w.state
    for i in range(steps):
        if i >= resident_from:
            with jax.transfer_guard_device_to_host("disallow_explicit"):
                state, loss, grads = parallel(state, w.batch)
            leaves = jax.tree.leaves(state.params)
            assert all(isinstance(x, jax.Array) for x in leaves), "parameters left the devices"
        else:
            state, loss, grads = parallel(state, w.batch)
        got = distributed.to_host((state.params, state.opt_state, loss, grads))
        for what, a, e in zip(("parameters", "optimizer state", "loss", "gradients"), got, expected[i]):
            assert_close(a, e, f"{name}: {what} after step {i}")
    distributed.barrier()
    if jax.process_index() == 0:
        print(f"CHECK {name} ok plan={parallel.plan.num_stages}stages", flush=True)
    return state


def check_pipeline(schedule: str) -> None:
    """One stage per device type; on 2 processes, one stage per process."""
    w = workload()
    cluster = hetpar.Cluster.from_file(sys.argv[1]).bind()
    par = hetpar.parallelize(with_grads(w.loss_fn), cluster=cluster, num_stages=len(cluster.groups),
                             num_microbatches=2, schedule=schedule)
    # hetpar launch keeps in-process collectives here (one node per group): a program
    # on the other process's mesh cannot even compile, so this process never dispatches one.
    assert not distributed.cross_process_collectives(), "one node per group, yet gloo collectives"
    compare(par, w, 3, f"pipeline-{schedule}")


def check_replicas() -> None:
    """Two data-parallel pipelines of different kinds, each with its own share of the
    batch, each updating its own copy of the state (kept between calls)."""
    w = workload(batch_size=12)
    cluster = hetpar.Cluster.from_file(sys.argv[1]).bind()
    par = hetpar.parallelize(with_grads(w.loss_fn), cluster=cluster, num_replicas=len(cluster.groups), num_microbatches=2)
    state = compare(par, w, 3, "replicas")  # steps 2 and 3: each replica on the state its own update made
    batch = list(par.plan.replica_batch)
    stage = par.plan.replica_stages(1)[0].index
    kept = par.compiled().kept  # every process keeps replica 1's copies of what replica 0 returned
    held = sum(kept.copy_of(x, stage) is not None for x in jax.tree.leaves(state.params))
    assert held == len(jax.tree.leaves(state.params)), f"replica 1 keeps {held} of the parameters"
    assert len(set(batch)) > 1, f"the replicas' batch shares are even ({batch}): the test wants uneven ones"
    if jax.process_index() == 0:
        print(f"CHECK replicas-uneven ok shares={batch}", flush=True)


def check_matrix() -> None:
    """The runtime matrix's cases (tests/test_runtime_matrix.py) with one stage mesh
    per process: interleaved chunks (two chunks on each process's mesh), dropout keyed
    from the state (bits drawn for the whole batch, sliced per microbatch), ZeRO-3."""
    from hetpar.options import ShardingOption, StageOption
    from test_runtime_matrix import dropout_case

    cluster = hetpar.Cluster.from_file(sys.argv[1]).bind()
    w = workload()
    par = hetpar.parallelize(with_grads(w.loss_fn), cluster=cluster, num_stages=2, num_microbatches=4, num_layers=4,
                             schedule="interleaved", chunks=2)
    compare(par, w, 2, "matrix-interleaved")
    assert par.plan.num_stages == 4 and par.plan.chunks == 2, par.plan.num_stages

    step, state, batch = dropout_case()
    par = hetpar.parallelize(step, cluster=cluster, num_stages=2, num_microbatches=2)
    reference = jax.jit(step)
    ref_state = jax.device_put(state, jax.local_devices()[0])
    for i in range(2):
        ref_state, ref_loss = reference(ref_state, batch)
        state, loss = par(state, batch)
        assert_close(distributed.to_host((state, loss)), jax.device_get((ref_state, ref_loss)), f"dropout: step {i}")
    assert par.compiled().step.analysis.sliced, "no dropout bits drawn for the whole batch"
    distributed.barrier()
    if jax.process_index() == 0:
        print("CHECK matrix-dropout ok", flush=True)

    w = models.get("mlp", batch_size=8, hidden=32, depth=3)
    par = hetpar.parallelize(with_grads(w.loss_fn), cluster=cluster, num_stages=2, num_layers=4, num_microbatches=2,
                             schedule="1f1b", stage_option=StageOption(mode="uniform"), sharding_option=ShardingOption(zero=3))
    compare(par, w, 2, "matrix-zero3")
    assert all(s.zero == 3 and s.gathered for s in par.plan.stages), "ZeRO-3 gathered no parameter"


def check_spanning() -> None:
    """Each stage a 2x2 mesh over two processes: its collectives run across them."""
    w = workload()
    cluster = hetpar.Cluster.from_file(sys.argv[1]).bind()
    par = hetpar.parallelize(with_grads(w.loss_fn), cluster=cluster, num_stages=2, num_microbatches=2, mesh_shape=(2, 2))
    assert distributed.cross_process_collectives(), "stages span processes: hetpar launch must pick gloo"
    compare(par, w, 2, "spanning")
    for s in par.plan.stages:
        processes = {jax.devices()[p].process_index for p in s.device_ids}
        assert len(processes) == 2, f"stage {s.index} is on processes {processes}; the check wants two"
        assert s.mesh_shape == (2, 2), f"stage {s.index} has mesh {s.mesh_shape}; the check wants 2x2"
    check_relayout_across_processes()


def check_relayout_across_processes() -> None:
    """A value changes its layout while it moves between two 2x2 meshes that each span
    two processes (JAX alone moves only shard for shard): rows over `data` there,
    columns over `model` here, and back replicated."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from hetpar.runtime.communicator import DevicePath

    def mesh(processes):
        return Mesh(np.array([d for d in jax.devices() if d.process_index in processes]).reshape(2, 2), ("data", "model"))

    there, here = mesh((0, 1)), mesh((2, 3))
    value = np.arange(24, dtype=np.float32).reshape(4, 6)
    sharding = NamedSharding(there, P("data", None))
    x = jax.make_array_from_callback(value.shape, sharding, lambda index: value[index], dtype=value.dtype)
    moved = DevicePath().to_mesh(x, NamedSharding(here, P(None, "model")))
    back = DevicePath().to_mesh(moved, NamedSharding(there, P()))
    for name, y in (("moved", moved), ("back", back)):
        np.testing.assert_array_equal(distributed.to_host(y), value, err_msg=f"relayout across processes: {name}")
    distributed.barrier()
    if jax.process_index() == 0:
        print("CHECK relayout ok", flush=True)


def inject(kind: str) -> None:
    """One good step, then a fault in process 1 while it runs stage 1 in step 2:
    an exception ("raise") or SIGKILL ("kill")."""
    import os
    import signal
    import time
    from dataclasses import replace

    w = workload()
    cluster = hetpar.Cluster.from_file(sys.argv[1]).bind()
    par = hetpar.parallelize(with_grads(w.loss_fn), cluster=cluster, num_stages=2, num_microbatches=2)
    state, _, _ = par(w.state, w.batch)
    jax.block_until_ready(state)
    if jax.process_index() == 1:
        step = par.compiled().step
        i = next(i for i, p in enumerate(step.programs) if p is not None and p.task.stage == 1 and p.task.kind == "fwd")
        def faulty(tracked):
            def fault(*args):
                tracked(*args)  # records stage 1 as the one running
                print(f"INJECT {time.time():.3f}", flush=True)
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected fault")

            return fault

        p = step.programs[i]  # its first microbatch runs `first` (which starts the accumulators), later ones `fn`
        step.programs[i] = replace(p, fn=faulty(p.fn), first=p.first and faulty(p.first))
    # Dispatch is asynchronous: process 0 may hand off all of step 2 before process 1
    # fails; waiting for its results is what must never end.
    jax.block_until_ready(par(state, w.batch))
    raise AssertionError("step 2 finished although process 1 failed in it")


def check_identity() -> None:
    """Process 1 closes over another constant (a loss scale), then runs a plan that
    differs from process 0's (another microbatch count): each time every process
    stops before the first step with the same line naming the field."""
    from dataclasses import replace

    w = workload()
    cluster = hetpar.Cluster.from_file(sys.argv[1]).bind()
    scale = 1.0 if jax.process_index() == 0 else 0.5
    grads_step = with_grads(w.loss_fn)

    def step(state, batch):
        state, loss, grads = grads_step(state, batch)
        return state, loss * scale, grads

    expect = {"constants": "process 1 is not running what process 0 runs: its values the step closes over",
              "plan": "process 1 is not running what process 0 runs: its plan differ(s) from process 0's; give every "
                      "process the same plan file"}
    try:
        hetpar.parallelize(step, cluster=cluster, num_stages=2, num_microbatches=2)(w.state, w.batch)
        raise AssertionError("a step ran although process 1 closes over another constant")
    except hetpar.HetparError as e:
        assert expect["constants"] in str(e), str(e)
    plan = hetpar.make_plan(grads_step, (w.state, w.batch), cluster, num_stages=2, num_microbatches=2)
    if jax.process_index() == 1:
        plan = replace(plan, num_microbatches=1)
    try:
        hetpar.parallelize(grads_step, plan=plan, cluster=cluster)(w.state, w.batch)
        raise AssertionError("a step ran although process 1 has another plan")
    except hetpar.HetparError as e:
        assert expect["plan"] in str(e), str(e)
    distributed.barrier()
    if jax.process_index() == 0:
        print("CHECK identity ok", flush=True)


def check_checkpoint() -> None:
    """Step 1 under one plan, a checkpoint (hetpar.save_checkpoint: orbax, every
    process), a restore, step 2 under another plan (another schedule and
    microbatch count): the same numbers as two uninterrupted steps of jax.jit."""
    import os

    w = workload()
    cluster = hetpar.Cluster.from_file(sys.argv[1]).bind()
    expected = reference(w, 2)
    first = hetpar.parallelize(with_grads(w.loss_fn), cluster=cluster, num_stages=2, num_microbatches=2)
    state, _, _ = first(w.state, w.batch)
    folder = os.environ[distributed.ENV_STATUS_DIR] + "/ckpt"  # the launch's own temporary folder
    hetpar.save_checkpoint(folder, state)
    assert os.path.isdir(folder), "the checkpoint is not complete when save_checkpoint returns"
    restored = hetpar.restore_checkpoint(folder, like=w.state)
    second = hetpar.parallelize(with_grads(w.loss_fn), cluster=cluster, num_stages=2, num_microbatches=4,
                                schedule="1f1b")
    state, loss, grads = second(restored, w.batch)
    got = distributed.to_host((state.params, state.opt_state, loss, grads))
    for what, a, e in zip(("parameters", "optimizer state", "loss", "gradients"), got, expected[1]):
        assert_close(a, e, f"checkpoint: {what} after the restored step")
    distributed.barrier()
    if jax.process_index() == 0:
        print("CHECK checkpoint ok", flush=True)


def check_transfer() -> None:
    """A value made on process 0's mesh, moved to process 1's with device_put, read back everywhere."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert jax.process_count() == 2 and jax.local_device_count() == 2, (jax.process_count(), jax.local_device_count())
    meshes = [Mesh(np.array([d for d in jax.devices() if d.process_index == p]), ("data",)) for p in (0, 1)]
    made = jax.jit(lambda: jnp.arange(12.0).reshape(4, 3) * 2, out_shardings=NamedSharding(meshes[0], PartitionSpec("data")))()
    moved = jax.device_put(made, NamedSharding(meshes[1], PartitionSpec("data")))
    np.testing.assert_array_equal(distributed.to_host(moved), np.arange(12.0).reshape(4, 3) * 2)
    if jax.process_index() == 0:
        print("CHECK transfer ok", flush=True)


def check_mixed() -> None:
    """A mixed-kind stage across processes: stage 0 on two A100s (process 0), stage 1
    split 3 + 2 rows of each 5-example microbatch between the other two A100s
    (process 0) and the V100s (process 1): rows cut and joined, gradients summed, across
    the processes."""
    from dataclasses import replace

    from hetpar.plan.mixed import Part, mix_stage

    w = workload(batch_size=10)
    cluster = hetpar.Cluster.from_file(sys.argv[1]).bind()
    plan = hetpar.make_plan(with_grads(w.loss_fn), (w.state, w.batch), cluster, num_stages=2, num_layers=4, num_microbatches=2)
    first, last = plan.stages
    assert first.group == "a100" and len(first.device_ids) == 4 and last.group == "v100", plan
    plan = replace(plan, stages=(replace(first, device_ids=first.device_ids[:2], mesh_shape=(2,), data_parallel=2), last))
    mixed = mix_stage(plan, 1, [Part("a100", first.device_ids[2:], 3), Part(last.group, last.device_ids, 2)])
    par = hetpar.parallelize(with_grads(w.loss_fn), cluster=cluster, plan=mixed)
    state = compare(par, w, 3, "mixed")  # steps 2 and 3: each part on the state its own update made
    assert par.plan.mixed_stages == (1,)
    kept = par.compiled().kept  # every process keeps the V100 part's copies of what the lead returned
    assert sum(kept.copy_of(x, 2) is not None for x in jax.tree.leaves(state.params)) == 4  # stage 1's two layers


CHECKS = {"mixed": check_mixed, "transfer": check_transfer, "gpipe": lambda: check_pipeline("gpipe"), "1f1b": lambda: check_pipeline("1f1b"), "replicas": check_replicas,
          "matrix": check_matrix, "spanning": check_spanning, "identity": check_identity, "checkpoint": check_checkpoint, "raise": lambda: inject("raise"), "kill": lambda: inject("kill")}

for name in sys.argv[2:]:
    CHECKS[name]()

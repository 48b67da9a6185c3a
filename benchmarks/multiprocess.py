"""What running over processes costs: the same plan in one process and over two
processes on jax.distributed (hetpar launch, loopback), and the measured speed of a
cross-process device_put between stage meshes.

The model is the GPT of benchmarks/ray_overhead.py (2 stages of 4 CPU devices, A100
and V100 labels, 4 microbatches). The plan is solved once, in this process, saved,
and run from the file by both runtimes, so they run identical programs. In the
multi-process run, process 0 holds stage 0 and process 1 stage 1; activations and
their gradients cross between them with device_put (JAX's cross-host transfers);
parameters and optimizer state stay on their devices.

Before the result, a breakdown of one serialized step per process (each stage
program blocked on, its inputs first): per stage, compute and the wait for its
inputs (transfers plus the other stage's work), what is left (dispatch, Python), and
the CPU time the process used in the step (all its threads); and the latency of one cross-process transfer of an activation-sized array.
`HETPAR_CPU_COLLECTIVES=gloo` in the environment runs the processes with gloo
collectives (hetpar launch's choice otherwise: in-process ones, see the README).

Ends with: RESULT mp_over_local=<ratio> transfer_gbps=<gigabits per second>
Run: .venv/bin/python benchmarks/multiprocess.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from step_timing import step_times  # noqa: E402  (beside this script)

ACTIVATION = (8, 64, 128)  # one microbatch's activation between the stages: batch 32 / 4, seq_len, d_model

CLUSTER = """name: mp-bench
groups:
  - {name: a100, device: A100, nodes: 1, devices_per_node: 4}
  - {name: v100, device: V100, nodes: 1, devices_per_node: 4}
links:
  - {between: [a100, v100], bandwidth: 12.5e+9, latency: 10.0e-6}
"""


def workload():
    from models import gpt

    config = gpt.GPTConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    return gpt.setup(batch_size=32, config=config)


def local(folder: Path, repeats: int) -> tuple[list[float], Callable[[], list[float]]]:
    """In one process on 8 devices; saves the plan for the multi-process run. Returns
    the step times and a function that times `repeats` more steps (run after the
    multi-process run too, so that both sides sample the machine's load alike)."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import hetpar

    w = workload()
    cluster = hetpar.Cluster.from_file(str(folder / "cluster.yaml")).bind()
    step = hetpar.parallelize(w.step, cluster=cluster, num_stages=2, num_microbatches=4, num_layers=4)
    times = step_times(step, w.state, w.batch, repeats)
    hetpar.save_plan(step.plan, folder / "plan.json")
    (folder / "local.json").write_text(json.dumps(breakdown(step, w, repeats)))
    return times, lambda: step_times(step, w.state, w.batch, repeats)


def breakdown(step, w, repeats: int) -> dict:
    """Per stage with programs in this process: seconds of compute and of waiting
    for inputs per serialized step, and the step's total (medians over `repeats`).
    Each local program is wrapped (in the compiled step's own program lists, as the
    fault-injection test does) and restored afterwards."""
    import jax

    from hetpar.runtime.distributed import DistributedStep
    from hetpar.runtime.remote import has_local_devices

    compiled = step.compiled()
    inner = compiled.step if isinstance(compiled, DistributedStep) else compiled
    spent: dict[str, float] = {}

    def timed(fn, stage: int):
        def call(*args):
            start = time.perf_counter()
            jax.block_until_ready(args)
            ready = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            spent[f"wait{stage}"] = spent.get(f"wait{stage}", 0.0) + ready - start
            spent[f"compute{stage}"] = spent.get(f"compute{stage}", 0.0) + time.perf_counter() - ready
            return out
        return call

    programs, fused = list(inner.programs), dict(inner.fused)
    for i, p in enumerate(programs):
        if p is not None and has_local_devices(p.mesh.devices.flat):
            inner.programs[i] = replace(p, fn=timed(p.fn, p.task.stage))
    for i, f in fused.items():
        if has_local_devices(f.mesh.devices.flat):
            inner.fused[i] = replace(f, fn=timed(f.fn, f.task.stage))
    rows = []
    state = w.state
    for _ in range(repeats):
        spent.clear()
        start, cpu = time.perf_counter(), time.process_time()
        state, out = step(state, w.batch)
        jax.block_until_ready((state, out))
        rows.append({**spent, "step": time.perf_counter() - start, "cpu": time.process_time() - cpu})
    inner.programs[:] = programs
    inner.fused.clear()
    inner.fused.update(fused)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def ping_pong(meshes, repeats: int) -> float:
    """Seconds per cross-process transfer of one activation, stage mesh to stage
    mesh: `repeats` round trips 0 -> 1 -> 0, each waiting on the last."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from hetpar.runtime import distributed
    from hetpar.runtime.remote import placeholder

    back, there = (NamedSharding(m, PartitionSpec("data")) for m in meshes)  # process 0's, process 1's
    if jax.process_index() == 0:
        x = jax.device_put(jnp.ones(ACTIVATION, jnp.float32), back)
    else:
        x = placeholder(jax.ShapeDtypeStruct(ACTIVATION, jnp.float32), back)
    x = jax.device_put(jax.device_put(x, there), back)  # warm up both directions
    jax.block_until_ready(x)
    distributed.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        x = jax.device_put(jax.device_put(x, there), back)
    jax.block_until_ready(x)
    seconds = (time.perf_counter() - start) / (2 * repeats)
    distributed.barrier()
    return seconds


def worker(folder: Path, repeats: int, megabytes: int) -> None:
    """Every process of the launch runs this; process 0 writes what it measured."""
    from hetpar.runtime import distributed

    distributed.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import hetpar
    from hetpar.runtime.remote import placeholder

    w = workload()
    step = hetpar.parallelize(w.step, plan=str(folder / "plan.json"), cluster=hetpar.Cluster.from_file(
        str(folder / "cluster.yaml")).bind())
    times = step_times(step, w.state, w.batch, repeats)
    parts = breakdown(step, w, repeats)

    # One stage mesh to the other: 4 shards of megabytes/4 each, process 0 -> process 1.
    meshes = [Mesh(np.array([d for d in jax.devices() if d.process_index == p]), ("data",)) for p in (0, 1)]
    rows = megabytes * 2**20 // 4 // 1024
    source = NamedSharding(meshes[0], PartitionSpec("data"))
    if jax.process_index() == 0:
        x = jax.jit(lambda: jnp.ones((rows, 1024), jnp.float32), out_shardings=source)()
    else:  # made on process 0 only (without cross-process collectives a program runs where its devices are)
        x = placeholder(jax.ShapeDtypeStruct((rows, 1024), jnp.float32), source)
    target = NamedSharding(meshes[1], PartitionSpec("data"))
    jax.block_until_ready(jax.device_put(x, target))
    transfers = []
    for _ in range(repeats):
        distributed.barrier()
        start = time.perf_counter()
        jax.block_until_ready(jax.device_put(x, target))
        distributed.barrier()
        transfers.append(time.perf_counter() - start)
    latency = ping_pong(meshes, 20)
    (folder / f"worker-{jax.process_index()}.json").write_text(json.dumps(
        {"step_s": times, "transfer_s": transfers, "bytes": x.nbytes, "breakdown": parts, "activation_s": latency,
         "collectives": "gloo" if distributed.cross_process_collectives() else "in-process"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--megabytes", type=int, default=64, help="size of the array moved between processes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the folder, in a launched process
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.repeats, args.megabytes)
        return

    from hetpar.cluster.cluster import Cluster
    from hetpar.runtime.launcher import launch_local

    folder = Path(tempfile.mkdtemp(prefix="hetpar-mp-bench-"))
    (folder / "cluster.yaml").write_text(CLUSTER)
    before, again = local(folder, args.repeats)
    launch_local(Cluster.from_file(str(folder / "cluster.yaml")),
                 [sys.executable, __file__, "--worker", str(folder), "--repeats", str(args.repeats),
                  "--megabytes", str(args.megabytes)], timeout_s=900)
    after = again()
    t_local = statistics.median(before + after)
    print(f"in one process (8 devices):           {t_local * 1e3:8.2f} ms per step (median of {2 * args.repeats}: "
          f"{statistics.median(before) * 1e3:.2f} before the 2-process run, {statistics.median(after) * 1e3:.2f} after)")
    workers = [json.loads((folder / f"worker-{i}.json").read_text()) for i in (0, 1)]
    measured = workers[0]
    t_mp = statistics.median(measured["step_s"])
    t_transfer = statistics.median(measured["transfer_s"])
    gbytes = measured["bytes"] / t_transfer / 1e9
    print(f"over 2 processes (4 devices each):    {t_mp * 1e3:8.2f} ms per step (median of {args.repeats}; "
          f"{measured['collectives']} collectives inside each process)")
    print(f"cross-process device_put of {measured['bytes'] / 2**20:.0f} MiB: {t_transfer * 1e3:8.2f} ms "
          f"({gbytes:.2f} GB/s, median of {args.repeats}, includes two barriers)")
    print(f"cross-process device_put of one activation {ACTIVATION}: {measured['activation_s'] * 1e3:.2f} ms "
          "(ping-pong between the stage meshes)")
    print("serialized step (each program blocked on, inputs first), ms, medians:")
    rows = [("one process", json.loads((folder / "local.json").read_text()))] + [
        (f"process {i}", w["breakdown"]) for i, w in enumerate(workers)]
    for name, row in rows:
        stages = sorted({int(k[7:]) for k in row if k.startswith("compute")})
        used = sum(v for k, v in row.items() if k not in ("step", "cpu"))
        cells = "  ".join(f"stage {s}: compute {row[f'compute{s}'] * 1e3:7.1f} wait {row[f'wait{s}'] * 1e3:7.1f}" for s in stages)
        print(f"  {name:12s} step {row['step'] * 1e3:7.1f}  {cells}  other {(row['step'] - used) * 1e3:6.1f}  "
              f"(process CPU time {row['cpu'] * 1e3:7.1f})")
    print(f"RESULT mp_over_local={t_mp / t_local:.3f} transfer_gbps={gbytes * 8:.2f}")


if __name__ == "__main__":
    main()

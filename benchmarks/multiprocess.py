"""What running over processes costs: the same plan in one process and over two
processes on jax.distributed (hetpar launch, loopback), and the measured speed of a
cross-process device_put between stage meshes.

The model is the GPT of benchmarks/ray_overhead.py (2 stages of 4 CPU devices, A100
and V100 labels, 4 microbatches). The plan is solved once, in this process, saved,
and run from the file by both runtimes, so they run identical programs. In the
multi-process run, process 0 holds stage 0 and process 1 stage 1; activations and
their gradients cross between them with device_put (JAX's cross-host transfers);
parameters and optimizer state stay on their devices.

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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from step_timing import step_times  # noqa: E402  (beside this script)

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


def local(folder: Path, repeats: int) -> float:
    """In one process on 8 devices; saves the plan for the multi-process run."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import hetpar

    w = workload()
    cluster = hetpar.Cluster.from_file(str(folder / "cluster.yaml")).bind()
    step = hetpar.parallelize(w.step, cluster=cluster, num_stages=2, num_microbatches=4, num_layers=4)
    median = statistics.median(step_times(step, w.state, w.batch, repeats))
    hetpar.save_plan(step.plan, folder / "plan.json")
    return median


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
    if jax.process_index() == 0:
        (folder / "worker.json").write_text(json.dumps({"step_s": times, "transfer_s": transfers, "bytes": x.nbytes}))


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
    t_local = local(folder, args.repeats)
    print(f"in one process (8 devices):           {t_local * 1e3:8.2f} ms per step (median of {args.repeats})")
    launch_local(Cluster.from_file(str(folder / "cluster.yaml")),
                 [sys.executable, __file__, "--worker", str(folder), "--repeats", str(args.repeats),
                  "--megabytes", str(args.megabytes)], timeout_s=900)
    measured = json.loads((folder / "worker.json").read_text())
    t_mp = statistics.median(measured["step_s"])
    t_transfer = statistics.median(measured["transfer_s"])
    gbytes = measured["bytes"] / t_transfer / 1e9
    print(f"over 2 processes (4 devices each):    {t_mp * 1e3:8.2f} ms per step (median of {args.repeats})")
    print(f"cross-process device_put of {measured['bytes'] / 2**20:.0f} MiB: {t_transfer * 1e3:8.2f} ms "
          f"({gbytes:.2f} GB/s, median of {args.repeats}, includes two barriers)")
    print(f"RESULT mp_over_local={t_mp / t_local:.3f} transfer_gbps={gbytes * 8:.2f}")


if __name__ == "__main__":
    main()

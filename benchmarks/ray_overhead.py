"""What one process per mesh costs: the Ray runtime against the in-process runtime,
same plan (GPT, 2 stages of 4 CPU virtual devices, 4 microbatches).

In the Ray runtime each stage is a separate process; values between stages, and the
step's inputs and outputs, travel as host arrays through Ray's object store, where
the in-process runtime copies device to device and keeps the state on the devices.
Ends with: RESULT ray_over_local=<ratio>
Run: .venv/bin/python benchmarks/ray_overhead.py
"""

from __future__ import annotations

import argparse
import statistics

import jax

jax.config.update("jax_num_cpu_devices", 8)

import hetpar  # noqa: E402
from step_timing import step_times  # noqa: E402
from models import gpt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    config = gpt.GPTConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    w = gpt.setup(batch_size=32, config=config)
    cluster = hetpar.Cluster.virtual({"A100": 4, "V100": 4})
    options = dict(cluster=cluster, num_stages=2, num_microbatches=4, num_layers=4)
    hetpar.init()
    times = {}
    for runtime in ("local", "ray"):
        step = hetpar.parallelize(w.step, runtime=runtime, **options)
        times[runtime] = statistics.median(step_times(step, w.state, w.batch, args.repeats, warmup=0))
        print(f"{runtime:>5}: {times[runtime] * 1e3:8.2f} ms per step")
        step.shutdown()
    hetpar.shutdown()
    print(f"RESULT ray_over_local={times['ray'] / times['local']:.3f}")


if __name__ == "__main__":
    main()

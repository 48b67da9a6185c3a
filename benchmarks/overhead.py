"""hetpar's step time against jax.jit on the same 8 CPU devices, for the GPT model.

The baseline is jax.jit data parallel over all 8 devices (batch sharded, parameters
replicated): what a user would run without hetpar. Figures are medians of timed
steps after warm-up; they are ratios because 8 virtual devices share this machine's
cores. Ends with: RESULT overhead_1stage=<ratio> overhead_2stage=<ratio>
Run: .venv/bin/python benchmarks/overhead.py
"""

import statistics

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import hetpar  # noqa: E402
from step_timing import gpt_benchmark, step_times  # noqa: E402


def main() -> None:
    args, w = gpt_benchmark(__doc__.splitlines()[0], iters=20)

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    state = jax.device_put(w.state, replicated)
    batch = jax.device_put(w.batch, split)
    baseline = statistics.median(step_times(jax.jit(w.step), state, batch, args.iters, warmup=3))
    print(f"jax.jit, data parallel on 8 devices: {baseline * 1e3:8.2f} ms/step")

    ratios = {}
    # One stage has no pipeline to fill, so it runs the batch whole, like the baseline.
    for stages, counts, microbatches in ((1, {"A100": 8}, 1), (2, {"A100": 4, "V100": 4}, args.microbatches)):
        step = hetpar.parallelize(
            w.step, cluster=hetpar.Cluster.virtual(counts), num_stages=stages,
            num_microbatches=microbatches, num_layers=args.layers,
        )
        t = statistics.median(step_times(step, w.state, w.batch, args.iters, warmup=3))
        ratios[stages] = t / baseline
        print(f"hetpar, {stages} stage(s), {microbatches} microbatch(es): {t * 1e3:8.2f} ms/step  ({t / baseline:.2f}x)")
    print(f"RESULT overhead_1stage={ratios[1]:.3f} overhead_2stage={ratios[2]:.3f}")


if __name__ == "__main__":
    main()

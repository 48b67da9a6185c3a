"""hetpar's step time against jax.jit on the same 8 CPU devices, for the GPT model.

The baseline is jax.jit data parallel over all 8 devices (batch sharded, parameters
replicated): what a user would run without hetpar. The contenders are hetpar with
one stage (the batch whole on all 8 devices, like the baseline) and with two (4 + 4
devices, microbatched). 8 virtual devices share this machine's cores, and other work
may share them too, so the contenders take turns: after all are warmed up, each
round times a few steps of each (the order rotating per round), and the figure is
the median over rounds of hetpar's time over jax.jit's in the same round. The
ratios of CPU time (this process's, all threads) are printed beside: on a loaded
machine wall time follows the share of the cores a contender gets, and a step whose
programs use fewer devices at a time (a pipeline stage's) runs fewer threads.
A fourth contender, one stage with the two-stage run's microbatches, shows what
microbatching costs by itself on these devices (each program gets a quarter of the
work, and per-op costs stay), the floor under the two-stage figure.
Ends with: RESULT overhead_1stage=<ratio> overhead_2stage=<ratio>
Run: .venv/bin/python benchmarks/overhead.py [--rounds 30 --iters 2]
"""

import os
import statistics

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import hetpar  # noqa: E402
from step_timing import Stepper, gpt_benchmark, interleaved_rounds, ratio_spread  # noqa: E402


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def main() -> None:
    args, w = gpt_benchmark(__doc__.splitlines()[0], iters=2, rounds=30)

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    # Every contender gets the same batch, laid out as data parallelism on 8 devices
    # wants it; hetpar moves it where its stages want it, inside the timed step.
    batch = jax.device_put(w.batch, split)
    contenders = {"jax.jit": Stepper(jax.jit(w.step), jax.device_put(w.state, replicated), batch)}
    # One stage has no pipeline to fill, so it runs the batch whole, like the baseline.
    setups = {1: ({"A100": 8}, 1), 2: ({"A100": 4, "V100": 4}, args.microbatches)}
    for stages, (counts, microbatches) in setups.items():
        step = hetpar.parallelize(
            w.step, cluster=hetpar.Cluster.virtual(counts), num_stages=stages,
            num_microbatches=microbatches, num_layers=args.layers,
        )
        contenders[f"hetpar {stages}"] = Stepper(step, w.state, batch)
    # The same microbatches on one stage: what cutting the batch costs by itself (on
    # 8 CPU devices a microbatch leaves each device a quarter of the work per
    # program), so the two-stage figure can be read as pipeline overhead on top.
    step = hetpar.parallelize(w.step, cluster=hetpar.Cluster.virtual({"A100": 8}), num_stages=1,
                              num_microbatches=args.microbatches, num_layers=args.layers)
    contenders["microbatched"] = Stepper(step, w.state, batch)
    for c in contenders.values():
        c.warm_up(4)

    print(f"before: {_load()}")
    rounds = interleaved_rounds(contenders, args.rounds, args.iters)
    print(f"after:  {_load()}")
    base = rounds.wall["jax.jit"]
    print(f"jax.jit, data parallel on 8 devices: {statistics.median(base) * 1e3:8.2f} ms/step (median of rounds; "
          f"rounds {min(base) * 1e3:.2f}..{max(base) * 1e3:.2f}), CPU {statistics.median(rounds.cpu['jax.jit']) * 1e3:.2f} ms/step")
    ratios = {}
    for stages, (_, microbatches) in setups.items():
        name = f"hetpar {stages}"
        ratios[stages] = rounds.ratios(name, "jax.jit")
        print(f"hetpar, {stages} stage(s), {microbatches} microbatch(es): {statistics.median(rounds.wall[name]) * 1e3:8.2f} ms/step\n"
              f"    per-round ratio to jax.jit: {ratio_spread(ratios[stages])}\n"
              f"    CPU time ratio (all threads): {ratio_spread(rounds.ratios(name, 'jax.jit', cpu=True))}")
    floor = rounds.ratios("microbatched", "jax.jit")
    print(f"hetpar, 1 stage, {args.microbatches} microbatches (the cost of microbatching alone): "
          f"{statistics.median(rounds.wall['microbatched']) * 1e3:8.2f} ms/step\n"
          f"    per-round ratio to jax.jit: {ratio_spread(floor)}\n"
          f"    two stages over this, per round: {ratio_spread(rounds.ratios('hetpar 2', 'microbatched'))}")
    print(f"RESULT overhead_1stage={statistics.median(ratios[1]):.3f} overhead_2stage={statistics.median(ratios[2]):.3f}")


if __name__ == "__main__":
    main()

"""A GPT step with stages on two kinds of device in one process: a GPU and the
host's CPU cores (`hetpar.Cluster.local()`), or two labelled CPU groups with
--virtual. Prints the plan, the loss against `jax.jit(step)` on one device, and the
planner's predicted step time against the measured one.
Ends with: RESULT predicted_step_s=<s> measured_step_s=<s> measured_over_predicted=<ratio> loss_diff=<abs>
Run: .venv/bin/python benchmarks/mixed_device.py [--virtual] [--cpu-devices N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--virtual", action="store_true", help="two CPU groups labelled A100 and cpu, for machines without a GPU")
    parser.add_argument("--cpu-devices", type=int, default=4, help="CPU devices the host's cores appear as")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.cpu_devices * (2 if args.virtual else 1))

    import hetpar
    from models import gpt

    cluster = hetpar.Cluster.virtual({"A100": args.cpu_devices, "cpu": args.cpu_devices}) if args.virtual else hetpar.Cluster.local()
    if len(cluster.groups) < 2:
        sys.exit(f"this process sees one kind of device ({cluster.describe()}); run it where JAX sees a GPU, or pass --virtual")
    config = gpt.GPTConfig(n_layers=8, d_model=256, n_heads=8, seq_len=128, vocab_size=1024)
    work = gpt.setup(batch_size=args.batch_size, config=config)
    step = hetpar.parallelize(work.step, cluster=cluster, num_stages=len(cluster.groups), num_layers=config.n_layers,
                              num_microbatches=4, schedule="1f1b")
    state, first_loss = step(work.state, work.batch)
    expected = jax.jit(work.step)(work.state, work.batch)[1]
    for s in step.plan.stages:
        print(f"stage {s.index}: {s.device_type} x{s.num_devices}, layers {s.layer_start}-{s.layer_end - 1}, "
              f"predicted {s.forward_s * 1e3:.2f} ms forward + {s.backward_s * 1e3:.2f} ms backward per microbatch")
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        state, loss = step(state, work.batch)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - started)
    measured, predicted = statistics.median(times), step.plan.predicted_step_time_s
    print(f"RESULT predicted_step_s={predicted:.4f} measured_step_s={measured:.4f} "
          f"measured_over_predicted={measured / predicted:.3f} loss_diff={abs(float(first_loss) - float(expected)):.2e}")


if __name__ == "__main__":
    main()

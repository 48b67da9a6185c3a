"""Does the runtime overlap stages, and how much memory does 1F1B save over GPipe?

A 4-stage GPT pipeline on 8 CPU virtual devices (2 per stage). The measured step
time is set against the sum of the same programs run one at a time (each blocking
until done), in the schedule's order: overlap_ratio < 1 means stages ran at the same
time. Then the peak bytes of activations the runtime holds, 1F1B over GPipe.
CPU virtual devices share the host's cores, so little overlap is possible here; on
separate accelerators the same code overlaps stage programs by asynchronous dispatch.
Ends with: RESULT overlap_ratio=<step/sum_of_stages> peak_mem_1f1b_over_gpipe=<ratio>
Run: .venv/bin/python benchmarks/pipeline_overlap.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import hetpar  # noqa: E402
from step_timing import step_times  # noqa: E402
from hetpar.predict.calibrate import time_program  # noqa: E402
from hetpar.runtime.executor import RunStats  # noqa: E402
from models import gpt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()

    config = gpt.GPTConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    w = gpt.setup(batch_size=32, config=config)
    cluster = hetpar.Cluster.virtual({"cpu": 8}) if jax.devices()[0].platform == "cpu" else hetpar.Cluster.local()
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        step = hetpar.parallelize(
            w.step, cluster=cluster, num_stages=4, num_microbatches=args.microbatches, num_layers=4, schedule=schedule
        )
        measured = statistics.median(step_times(step, w.state, w.batch, args.repeats, warmup=0))
        compiled = step.compiled()
        # A fused step (a stage's last backward with its update) counts its two programs apart.
        timed = [i for s in compiled.order if not s.combine for i in (s.program, s.fused) if i is not None]
        one_by_one = sum(time_program(compiled.programs[i], compiled.graph, args.repeats) for i in timed)
        stats = RunStats()
        step.call_with_stats(w.state, w.batch, stats=stats)
        peaks[schedule] = sum(stats.peak_activation_bytes.values())
        ratio = measured / one_by_one
        print(
            f"{schedule:>5}: step {measured * 1e3:8.2f} ms, programs one by one {one_by_one * 1e3:8.2f} ms "
            f"(ratio {ratio:.2f}), peak activations held {peaks[schedule] / 2**20:.2f} MiB "
            f"({', '.join(f'stage {k}: {v / 2**20:.2f}' for k, v in sorted(stats.peak_activation_bytes.items()))})"
        )
        if schedule == "gpipe":
            overlap = ratio
    print(f"RESULT overlap_ratio={overlap:.3f} peak_mem_1f1b_over_gpipe={peaks['1f1b'] / peaks['gpipe']:.3f}")


if __name__ == "__main__":
    main()

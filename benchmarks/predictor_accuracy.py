"""How well the predictor knows this machine: predicted against measured time of the
GPT model's layers, whole stage programs, and full steps for several plans, and
predicted against compiled memory.

Calibrates first with the same measurement as `hetpar profile` (matmul throughput
over sizes, memory bandwidth, launch overhead, all-reduce), then predicts every
figure from the profile and the traced program alone. Layers are the stage programs
of a plan with one layer per stage. Memory is compared with XLA's
`compiled.memory_analysis()` (arguments + outputs + temporaries - aliased).
Ends with: RESULT median_time_err=<f> max_time_err=<f> median_mem_err=<f>
Run: .venv/bin/python benchmarks/predictor_accuracy.py   (runs unchanged on a GPU machine)
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402

import hetpar  # noqa: E402
from hetpar.predict.profile import profile_local  # noqa: E402
from hetpar.predict.step import predict_step  # noqa: E402
from models import gpt  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def program_inputs(program, graph):
    args = [jax.device_put(jnp.zeros(graph.avals[v].shape, graph.avals[v].dtype), s) for v, s in zip(program.task.inputs, program.in_shardings)]
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    kind = hetpar.Cluster.local().groups[0].type_name
    n = len(jax.devices())
    profile = profile_local(mesh_size=min(4, n))
    cluster = hetpar.Cluster.virtual({kind: n}) if kind == "cpu" else hetpar.Cluster.local()
    concurrent = kind != "cpu"  # CPU virtual devices share the host's cores

    config = gpt.GPTConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    w = gpt.setup(batch_size=args.batch_size, config=config)
    plans = [(4, 1), (1, 1), (1, 4), (2, 2), (2, 4)]  # (stages, microbatches); 4 stages = one layer each

    rows, time_errors, mem_errors = [], [], []
    for stages, microbatches in plans:
        step = hetpar.parallelize(w.step, cluster=cluster, num_stages=stages, num_microbatches=microbatches, num_layers=4)
        step(w.state, w.batch)
        compiled, plan = step.compiled(), step.plan
        prediction = predict_step(compiled, plan, cluster, profile, concurrent=concurrent, tokens=w.batch["tokens"].size)
        for program, estimate in zip(compiled.programs, prediction.programs):
            inputs = program_inputs(program, compiled.graph)
            run = lambda: program.fn(program.init_acc() if program.init_acc else (), *inputs)
            measured = timed(run, args.repeats)
            lowered = program.fn.lower(program.init_acc() if program.init_acc else (), *inputs)
            mem = lowered.compile().memory_analysis()
            actual_mem = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
            level = "layer" if stages == 4 and program.task.per_microbatch else "stage program"
            label = f"{level} {program.task.name} ({stages} stg, {microbatches} mb)"
            rows.append((label, estimate.time_s, measured, estimate.memory_bytes, actual_mem))
        measured_step = timed(lambda: step(w.state, w.batch), args.repeats)
        rows.append((f"full step ({stages} stg, {microbatches} mb)", prediction.step_s, measured_step, None, None))

    print(f"{'what':<44} {'pred ms':>9} {'meas ms':>9} {'err':>7} {'pred MB':>8} {'XLA MB':>8} {'err':>7}")
    for label, pred, meas, pmem, amem in rows:
        err = abs(pred - meas) / meas
        time_errors.append(err)
        mem_txt = ""
        if pmem is not None and amem:
            merr = abs(pmem - amem) / amem
            mem_errors.append(merr)
            mem_txt = f"{pmem / 1e6:>8.2f} {amem / 1e6:>8.2f} {merr:>7.1%}"
        print(f"{label:<44} {pred * 1e3:>9.3f} {meas * 1e3:>9.3f} {err:>7.1%} {mem_txt}")
    print(
        f"RESULT median_time_err={statistics.median(time_errors):.3f} max_time_err={max(time_errors):.3f} "
        f"median_mem_err={statistics.median(mem_errors):.3f}"
    )


if __name__ == "__main__":
    main()

"""How well the predictor knows this machine: predicted against measured time of the
GPT model's layers, whole stage programs, and full steps for several plans, and
predicted against compiled memory.

Calibrates with the same measurements as `hetpar profile --model gpt` (matmul
throughput over sizes, memory bandwidth, launch overhead, all-reduce, and the GPT
model's layers timed one by one at other batch sizes than the one predicted), then
predicts every figure from the profile and the traced program alone. On CPU virtual
devices the calibration is taken on meshes of 2, 4 and 8 devices (`--mesh-sizes`, as
`hetpar profile --mesh-sizes` does): devices of one host share its cores, and how
well they share them is measured per mesh size, not assumed proportional. The
calibration fits five figures per mesh size (launch, matmul, vector and transpose
scales, a cost per kernel) on single layers at two batch sizes; the rows are whole stage
programs and steps of other plans at a third batch size. The
calibration's layer programs and every row are timed in one pool by
`hetpar.predict.timing.steady_times`: warm-up runs, then rounds in which every
program and step runs a few times in turn, the least per item. Interleaved, the
calibration and every row see the same moments of a busy shared host (timed one
after the other, the very same program measured up to 40% apart a minute later).
On CPU virtual devices time is the process's CPU time (the core-seconds the
devices' work takes, which other processes on a shared host inflate far less than
wall time; see timing.py); on accelerators it is wall time. Full steps also show
their wall time on CPU, for reference only: on a loaded host it measures the
neighbours (the `uptime` load average is printed). Layers are the stage programs
of a plan with one layer per stage. Memory is compared with XLA's
`compiled.memory_analysis()` (arguments + outputs + temporaries - aliased).
Ends with: RESULT median_time_err=<f> max_time_err=<f> median_mem_err=<f> median_step_wall_err=<f> load=<f>
Run: .venv/bin/python benchmarks/predictor_accuracy.py   (runs unchanged on a GPU machine)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)


import hetpar  # noqa: E402
from hetpar.cluster.cluster import jax_devices  # noqa: E402
from hetpar.predict.calibrate import layer_samples, program_inputs, program_run  # noqa: E402
from hetpar.predict.profile import LayerWorkload, Profile, calibration_programs, measure, with_layers, with_meshes  # noqa: E402
from hetpar.predict.step import predict_step  # noqa: E402
from hetpar.predict.timing import busy_clock, steady_times  # noqa: E402
from models import gpt  # noqa: E402


def training_run(step, state, batch):  # noqa: ANN001, ANN201
    """One step of a training loop, to time: each step takes the state the last one
    returned, so it already lives where the plan keeps it."""
    carried = [step(state, batch)[0]]

    def run():
        carried[0], loss = step(carried[0], batch)
        return carried[0], loss

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each item per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--calibration-batch-sizes", default="12,24", help="batches the layers are profiled at")
    parser.add_argument("--mesh-sizes", default="2,4,8",
                        help="CPU: mesh sizes the layers are profiled on (the first is the profile's own; "
                        "a plan's mesh is predicted from the nearest)")
    args = parser.parse_args()

    group = hetpar.Cluster.local().groups[0]
    kind = group.type_name
    n = len(jax.devices())
    config = gpt.GPTConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64, vocab_size=256)
    calibration = []
    for size in map(int, args.calibration_batch_sizes.split(",")):
        c = gpt.setup(batch_size=size, config=config)
        calibration.append(LayerWorkload(f"gpt batch {size}", c.step, (c.state, c.batch), num_layers=4))
    sizes = [s for s in map(int, args.mesh_sizes.split(",")) if s <= n] if kind == "cpu" else [min(4, n)]
    # The micro-benchmarks, as `hetpar profile` takes them, on each mesh size.
    entries = {size: measure(jax_devices(group.device_ids[:size]), kind) for size in sizes}
    programs = {size: calibration_programs(entry, calibration, group.device_ids[:size]) for size, entry in entries.items()}
    layer_programs = [p for size in sizes for p in programs[size]]
    cluster = hetpar.Cluster.virtual({kind: n}) if kind == "cpu" else hetpar.Cluster.local()
    concurrent = kind != "cpu"  # CPU virtual devices share the host's cores

    w = gpt.setup(batch_size=args.batch_size, config=config)
    plans = [(4, 1), (1, 1), (1, 4), (2, 2), (2, 4)]  # (stages, microbatches); 4 stages = one layer each

    # Everything to time, in one pool: the calibration's layer programs, then per plan
    # its programs and its training step (busy clock; on CPU also wall time, for reference).
    runs, clocks = [p.run for p in layer_programs], [None] * len(layer_programs)
    built = []
    for stages, microbatches in plans:
        step = hetpar.parallelize(w.step, cluster=cluster, num_stages=stages, num_microbatches=microbatches, num_layers=4)
        step(w.state, w.batch)
        compiled, plan = step.compiled(), step.plan
        first = len(runs)
        memory = []
        for program in compiled.programs:
            runs.append(program_run(program, compiled.graph))
            clocks.append(None)
            lowered = program.fn.lower(program.init_acc() if program.init_acc else (), *program_inputs(program, compiled.graph))
            mem = lowered.compile().memory_analysis()
            memory.append(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
        runs.append(training_run(step, w.state, w.batch))
        clocks.append(None)
        if busy_clock() is not time.perf_counter:
            runs.append(training_run(step, w.state, w.batch))
            clocks.append(time.perf_counter)
        built.append((stages, microbatches, compiled, plan, first, memory))

    loads = [os.getloadavg()[0]]
    measured = steady_times(runs, args.repeats, args.rounds, clocks=clocks)
    loads.append(os.getloadavg()[0])

    at = 0
    for size in sizes:
        with_layers(entries[size], calibration, layer_samples(programs[size], measured[at : at + len(programs[size])]))
        at += len(programs[size])
        model = entries[size].compute
        print(
            f"calibration on {size} devices: launch x{model.launch_scale:.2f} matmul x{model.matmul_scale:.2f} "
            f"vector x{model.vector_scale:.2f} transposes x{model.transpose_scale:.2f}, {model.op_overhead_s * 1e6:.1f} us per kernel"
        )
    profile = Profile({kind: with_meshes(entries[sizes[0]], [entries[s] for s in sizes[1:]])})

    rows, time_errors, mem_errors, wall_errors = [], [], [], []
    for stages, microbatches, compiled, plan, first, memory in built:
        prediction = predict_step(compiled, plan, cluster, profile, concurrent=concurrent, tokens=w.batch["tokens"].size)
        for k, (program, estimate) in enumerate(zip(compiled.programs, prediction.programs)):
            level = "layer" if stages == 4 and program.task.per_microbatch else "stage program"
            label = f"{level} {program.task.name} ({stages} stg, {microbatches} mb)"
            rows.append((label, estimate.time_s, measured[first + k], estimate.memory_bytes, memory[k], estimate.communication_s))
        at = first + len(compiled.programs)
        rows.append((f"full step ({stages} stg, {microbatches} mb)", prediction.step_s, measured[at], None, None, prediction.communication_s))
        if busy_clock() is not time.perf_counter:
            wall = measured[at + 1]
            wall_errors.append(abs(prediction.step_s - wall) / wall)
            rows.append(("  (wall clock)", prediction.step_s, wall, None, None, prediction.communication_s))
    print(f"{'what':<44} {'pred ms':>9} {'(comm)':>8} {'meas ms':>9} {'err':>7} {'pred MB':>8} {'XLA MB':>8} {'err':>7}")
    for label, pred, meas, pmem, amem, comm in rows:
        err = abs(pred - meas) / meas
        if not label.startswith("  (wall"):
            time_errors.append(err)
        mem_txt = ""
        if pmem is not None and amem:
            merr = abs(pmem - amem) / amem
            mem_errors.append(merr)
            mem_txt = f"{pmem / 1e6:>8.2f} {amem / 1e6:>8.2f} {merr:>7.1%}"
        print(f"{label:<44} {pred * 1e3:>9.3f} {comm * 1e3:>8.3f} {meas * 1e3:>9.3f} {err:>7.1%} {mem_txt}")
    print(
        f"RESULT median_time_err={statistics.median(time_errors):.3f} max_time_err={max(time_errors):.3f} "
        f"median_mem_err={statistics.median(mem_errors):.3f} "
        f"median_step_wall_err={statistics.median(wall_errors) if wall_errors else 0.0:.3f} load={statistics.mean(loads):.1f}"
    )


if __name__ == "__main__":
    main()

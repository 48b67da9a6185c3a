"""Gradient reduction traffic of data-parallel stages, per step: the all-reduces in
the compiled programs of one step, counted over every dispatch the schedule makes,
and the step time, for the GPT model on two 4-device data-parallel stages.

Each program's all-reduces are read from its compiled HLO (XLA's result types, one
per reduced buffer) and multiplied by how often the step dispatches it: once per
microbatch for a stage's forward or backward, once for its last microbatch's fused
update, once for a `finish`. On CPU virtual devices an all-reduce is a memory copy,
so the time changes little; the counts are what scale with real links.
Ends with: RESULT all_reduces_per_step=<n> all_reduce_mib_per_step=<MiB> ms_per_step=<ms>
Run: .venv/bin/python benchmarks/grad_reduction.py
"""

import re
import statistics

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import hetpar  # noqa: E402
from step_timing import gpt_benchmark, step_times  # noqa: E402

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "pred": 1}


def all_reduces(hlo: str) -> list[int]:
    """Bytes of each all-reduced buffer (a tuple-typed all-reduce gives each)."""
    sizes = []
    for result in re.findall(r"= (.+?) all-reduce(?:-start)?\(", hlo):
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            sizes.append(_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d])))
    return sizes


def step_all_reduces(compiled) -> list[int]:  # noqa: ANN001
    """Bytes of every buffer all-reduced in one step, over the schedule's dispatches."""
    cache: dict = {}

    def of(key, lower) -> list[int]:  # noqa: ANN001
        if key not in cache:
            cache[key] = all_reduces(lower().compile().as_text())
        return cache[key]

    out: list[int] = []
    for item in compiled.order:
        if item.combine:
            continue
        program = compiled.programs[item.program]
        if item.fused is not None:
            out += of(("fused", item.program), compiled.fused[item.program].lower)
            continue
        out += of(("program", item.program), program.lower)
        if item.last_microbatch and program.finish is not None:
            out += of(("finish", item.program), lambda: program.finish.lower(program.arg_types[0]))
    return out


def main() -> None:
    args, w = gpt_benchmark(__doc__.splitlines()[0], iters=10)
    step = hetpar.parallelize(w.step, cluster=hetpar.Cluster.virtual({"A100": 4, "V100": 4}), num_stages=2,
                              num_microbatches=args.microbatches, num_layers=args.layers, mesh_shape=(4, 1))
    t = statistics.median(step_times(step, w.state, w.batch, args.iters, warmup=2))
    print("stages:", [(s.device_type, s.mesh_shape, s.zero) for s in step.plan.stages])
    sizes = step_all_reduces(step.compiled())
    mib = sum(sizes) / 2**20
    print(f"{args.microbatches} microbatches: {len(sizes)} all-reduced buffers per step, {mib:.2f} MiB; {t * 1e3:.2f} ms/step")
    print(f"RESULT all_reduces_per_step={len(sizes)} all_reduce_mib_per_step={mib:.3f} ms_per_step={t * 1e3:.2f}")


if __name__ == "__main__":
    main()

"""Memory per device, as XLA reports it for the compiled stage programs
(`compiled.memory_analysis()`), and as the one memory model (solver.memory) predicts.

Section "zero": a GPT stage on 4 devices; the state one device holds (parameters,
gradients, Adam's two moments: the arguments of the stage's optimizer-update program)
with the state replicated over the 4-way data axis, and at ZeRO-1, -2 and -3. Goal:
ZeRO-3 at most 0.3 of replicated (the ideal is 0.25: everything split 4 ways).

Sections "remat" and "predicted": a GPT stage sized so activations dominate (long
sequences, narrow model) is the first of two single-device pipeline stages under
GPipe, so it holds every microbatch's activations before its first backward.
Measured, from `memory_analysis()` of its compiled programs: the state the step keeps
(parameters, optimizer state, gradient accumulators), the activations its forward
program returns for the backward times the microbatches in flight but one, and the
backward program's arguments, outputs and temporaries (less what it aliases) while
it runs the last of them. Predicted: the plan's `memory_bytes`, by solver.memory from
the traced layers. Goal: predicted/measured within 0.9-1.1. `--seq-len` and
`--remat-d-model` size that GPT (default 256 and 32).

The stage programs are measured twice: as they run (XLA:CPU's defaults), and as XLA
compiles them with its YNNPACK fusions off (`NO_YNN`). XLA:CPU's experimental YNNPACK
fusions, a CPU kernel library's, choose by tensor size whether a fused reduction
reads a broadcast operand in place or as a full-size buffer; from sequence length 256
on, every attention block's softmax denominator is then held broadcast to the scores'
shape while the backward runs (three score-sized buffers per block, not two). No
accelerator backend the planner plans for has these fusions, and the model does not
try to tell where the library switches: its figure is checked against the second
measurement (tests/test_memory_model.py), and both are printed.

Section "offload": the zero section's GPT stage with its optimizer state kept in host
memory (`StageOption(offload="host")`) and without. After a step, the bytes of the
optimizer state the step returned that lie on one device of the stage in device
memory, read from the real arrays (each shard's memory kind), not from the model;
the ratio is with offload over without. Goal: at most 0.05 (what stays on the device
is Adam's step count).

Section "nvme": the same stage with its optimizer state on the NVMe tier
(`StageOption(offload="nvme")`: a file store, hetpar/runtime/nvme_store.py) and
without. After a step, the optimizer-state bytes one device of the stage holds in
device memory and in host memory, read from the real arrays, and the bytes of the
store's newest generation, read from its files; the ratios are with the NVMe tier
over without (on the device). Goal: device and host ratios at most 0.05 (Adam's step
count stays on the device), and the files about one copy of the state.

Each section is one function returning its RESULT figure; main prints them on one line:
RESULT zero3_over_replicated=<ratio> remat_over_saved=<ratio> predicted_over_measured_mem=<ratio>
predicted_over_measured_mem_as_run=<ratio> offload_device_state_ratio=<ratio> nvme_device_state_ratio=<ratio>
nvme_host_state_ratio=<ratio> nvme_disk_state_ratio=<ratio> (the first two measured without
YNNPACK, predicted_over_measured_mem_as_run with XLA:CPU's defaults)
Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/memory.py [--seq-len 128] [--sections remat,predicted,offload,nvme]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402

import hetpar  # noqa: E402
from hetpar.options import RuntimeOption, ShardingOption, StageOption  # noqa: E402
from hetpar.trace.microbatch import input_roles  # noqa: E402
from models import gpt  # noqa: E402

CONFIG = gpt.GPTConfig(vocab_size=64, seq_len=256, d_model=32, n_heads=4, n_layers=4)
BATCH, MICROBATCHES = 16, 4
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}  # no YNNPACK fusions (module docstring)

DEVICES = 4  # the zero section's data axis


def _config(args: argparse.Namespace) -> gpt.GPTConfig:
    return gpt.GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=4, seq_len=32, vocab_size=256)


def _stage_memory(workload, **options) -> dict[str, object]:
    """One step of `workload` as a single stage on DEVICES devices; each compiled
    program's memory analysis, by task kind."""
    step = hetpar.parallelize(workload.step, cluster=hetpar.Cluster.virtual({"cpu": DEVICES}), num_stages=1,
                              num_microbatches=2, **options)
    step(workload.state, workload.batch)
    return {p.task.kind: p.lower().compile().memory_analysis() for p in step.compiled().programs}


def zero_section(args: argparse.Namespace) -> str:
    """State bytes per device at ZeRO 0-3 (the update program's arguments: every
    parameter, its gradient and its optimizer state, as one device holds them)."""
    workload = gpt.setup(batch_size=args.batch_size, config=_config(args))
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(workload.state.params))
    print(f"GPT stage: {params / 2**20:.2f} MiB of parameters, Adam, {DEVICES} devices (data axis {DEVICES})")
    print(f"  {'state':<11} {'state/device':>13} {'x replicated':>13} {'fwd+bwd peak/device':>20}")
    state = {}
    for zero in (0, 1, 2, 3):
        memory = _stage_memory(workload, sharding_option=ShardingOption(zero=zero))
        state[zero] = memory["post"].argument_size_in_bytes
        # The last (here: only) stage's forward and backward are one program.
        work = memory["fwd"]
        peak = work.argument_size_in_bytes + work.temp_size_in_bytes + work.output_size_in_bytes - work.alias_size_in_bytes
        name = "replicated" if zero == 0 else f"ZeRO-{zero}"
        print(f"  {name:<11} {state[zero] / 2**20:>9.2f} MiB {state[zero] / state[0]:>13.3f} {peak / 2**20:>16.2f} MiB")
    return f"zero3_over_replicated={state[3] / state[0]:.3f}"


def placed_bytes(tree, device) -> dict[str, int]:  # noqa: ANN001
    """Bytes of `tree`'s arrays on `device`, by the memory kind each shard lies in."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):  # an NVMe-tier handle has none: no memory
            if shard.device == device:
                kind = shard.data.sharding.memory_kind or "device"
                out[kind] = out.get(kind, 0) + shard.data.nbytes
    return out


def offload_section(args: argparse.Namespace) -> str:
    """Optimizer-state bytes one device of a 4-device GPT stage holds in device
    memory after a step, with the state offloaded to host memory and without."""
    workload = gpt.setup(batch_size=args.batch_size, config=_config(args))
    placed = {}
    for offload in ("", "host"):
        step = hetpar.parallelize(workload.step, cluster=hetpar.Cluster.virtual({"cpu": DEVICES}), num_stages=1,
                                  num_microbatches=2, stage_option=StageOption(offload=offload))
        state, _ = step(workload.state, workload.batch)
        stage = step.plan.stages[0]
        device = jax.devices()[stage.device_ids[0]]  # a virtual cluster's positions are JAX's device order
        placed[offload] = placed_bytes(state.opt_state, device)
        print(f"  offload={offload or 'none':5s} optimizer state on {device}: "
              + ", ".join(f"{kind} {n:,} bytes" for kind, n in sorted(placed[offload].items()))
              + f"; the plan predicts {stage.host_bytes:,} bytes per device in host memory")
    ratio = placed["host"].get("device", 0) / placed[""]["device"]
    return f"offload_device_state_ratio={ratio:.2g}"


def stage_memory(remat: str, stage: int = 0, config: gpt.GPTConfig = CONFIG,
                 options: dict | None = NO_YNN) -> tuple[int, int]:
    """(predicted, measured) peak bytes on a device of `stage` of a two-stage GPipe
    GPT plan (one device per stage) whose stages recompute under `remat`, its
    programs compiled with `options` for the measurement (None: as they run)."""
    compiled, plan = _planned(remat, config)
    return plan.stages[stage].memory_bytes, measured_peak(compiled, plan, stage, options)


@lru_cache(maxsize=None)
def _planned(remat: str, config: gpt.GPTConfig) -> tuple:
    """The compiled two-stage step and its plan, after one step."""
    w = gpt.setup(batch_size=BATCH, config=config)
    step = hetpar.parallelize(w.step, cluster=hetpar.Cluster.virtual({"A100": 1, "V100": 1}), num_stages=2,
                              num_microbatches=MICROBATCHES, num_layers=config.n_layers, schedule="gpipe",
                              stage_option=StageOption(remat=remat))
    step(w.state, w.batch)
    return step.compiled(), step.plan


def measured_peak(compiled, plan: hetpar.Plan, stage: int, options: dict | None = NO_YNN) -> int:  # noqa: ANN001
    """What XLA's memory analysis says a device of `stage` holds while its backward
    runs on the last microbatch in flight (see the module docstring)."""
    graph = compiled.graph
    roles = input_roles(graph, compiled.analysis, sorted(compiled.batch_invars))
    programs = {p.task.kind: p for p in compiled.programs if p.task.stage == stage}
    fwd, bwd = programs["fwd"], programs["bwd"]
    analysis = {kind: p.lower().compile(compiler_options=options).memory_analysis()
                for kind, p in (("fwd", fwd), ("bwd", bwd))}
    kept = sum(graph.nbytes(v) for v in fwd.task.outputs if v in set(bwd.task.inputs))
    optimizer = sum(graph.nbytes(v) for p in compiled.programs if p.task.stage == stage for v in p.task.inputs
                    if roles.get(v) == "optimizer_state")
    held = MICROBATCHES if plan.schedule == "gpipe" else 1
    b = analysis["bwd"]
    running = b.argument_size_in_bytes + b.output_size_in_bytes - b.alias_size_in_bytes + b.temp_size_in_bytes
    return int(running + kept * (held - 1) + optimizer)


@lru_cache(maxsize=None)
def _measured(remat: str, config: gpt.GPTConfig = CONFIG, as_run: bool = False) -> tuple[int, int]:
    return stage_memory(remat, config=config, options=None if as_run else NO_YNN)


def _stage_config(args: argparse.Namespace) -> gpt.GPTConfig:
    return replace(CONFIG, seq_len=args.seq_len, d_model=args.remat_d_model)


def remat_section(args: argparse.Namespace) -> str:
    """Peak bytes of the first stage with and without full recomputation (measured)."""
    config = _stage_config(args)
    none, full = _measured("", config)[1], _measured("full", config)[1]
    print(f"stage 0 peak, measured: no recomputation {none / 2**20:.2f} MiB, full {full / 2**20:.2f} MiB")
    return f"remat_over_saved={full / none:.3f}"


def predicted_vs_measured_section(args: argparse.Namespace) -> str:
    """solver.memory's figure (the plan's memory_bytes) against the measured peak,
    per policy, without YNNPACK and as run; the RESULT figures are the recomputing
    ("full") stage's."""
    config = _stage_config(args)
    for remat in ("", "full", "dots"):
        predicted, measured = _measured(remat, config)
        _, as_run = _measured(remat, config, as_run=True)
        print(f"remat={remat or 'none':5s} stage 0 peak: predicted {predicted / 2**20:8.2f} MiB, measured "
              f"{measured / 2**20:8.2f} MiB ({predicted / measured:.3f}) without YNNPACK, "
              f"{as_run / 2**20:8.2f} MiB ({predicted / as_run:.3f}) as run")
    predicted, measured = _measured("full", config)
    _, as_run = _measured("full", config, as_run=True)
    return f"predicted_over_measured_mem={predicted / measured:.3f} predicted_over_measured_mem_as_run={predicted / as_run:.3f}"


def nvme_section(args: argparse.Namespace) -> str:
    """Optimizer-state bytes one device of a 4-device GPT stage holds in device and
    host memory after a step, and the bytes on disk, with the NVMe tier and without."""
    workload = gpt.setup(batch_size=args.batch_size, config=_config(args))
    placed, disk = {}, 0
    with tempfile.TemporaryDirectory(prefix="hetpar-nvme-bench-") as folder:
        for offload in ("", "nvme"):
            step = hetpar.parallelize(workload.step, cluster=hetpar.Cluster.virtual({"cpu": DEVICES}), num_stages=1,
                                      num_microbatches=2, stage_option=StageOption(offload=offload),
                                      runtime_option=RuntimeOption(nvme_dir=folder))
            state, _ = step(workload.state, workload.batch)
            stage = step.plan.stages[0]
            device = jax.devices()[stage.device_ids[0]]
            placed[offload] = placed_bytes(state.opt_state, device)
            if offload:
                disk = (Path(folder) / f"gen-{step.nvme_store.generation:08d}.bin").stat().st_size  # the step's file
            print(f"  offload={offload or 'none':5s} optimizer state on {device}: "
                  + (", ".join(f"{kind} {n:,} bytes" for kind, n in sorted(placed[offload].items())) or "none")
                  + (f"; on disk {disk:,} bytes; the plan predicts {stage.nvme_bytes:,} bytes per device on disk and "
                     f"{stage.host_bytes:,} in host memory while the update runs" if offload else ""))
    on_device = placed[""]["device"]
    return (f"nvme_device_state_ratio={placed['nvme'].get('device', 0) / on_device:.2g} "
            f"nvme_host_state_ratio={placed['nvme'].get('pinned_host', 0) / on_device:.2g} "
            f"nvme_disk_state_ratio={disk / on_device:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8, help="zero section: the GPT stage's batch")
    parser.add_argument("--layers", type=int, default=4, help="zero section: GPT blocks")
    parser.add_argument("--d-model", type=int, default=128, help="zero section: GPT width")
    parser.add_argument("--seq-len", type=int, default=CONFIG.seq_len, help="remat and predicted sections: GPT sequence length")
    parser.add_argument("--remat-d-model", type=int, default=CONFIG.d_model, help="remat and predicted sections: GPT width")
    parser.add_argument("--sections", default="zero,remat,predicted,offload,nvme",
                        help="comma-separated sections to run (zero, remat, predicted, offload, nvme); RESULT has their figures")
    args = parser.parse_args()
    sections = {"zero": zero_section, "remat": remat_section, "predicted": predicted_vs_measured_section,
                "offload": offload_section, "nvme": nvme_section}
    chosen = args.sections.split(",")
    unknown = [name for name in chosen if name not in sections]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(sections)}")
    print(f"jax {jax.__version__}")
    figures = []
    for name in chosen:
        if name in ("remat", "predicted") and all(n in ("zero", "offload", "nvme") for n in chosen[:chosen.index(name)]):
            print(f"GPT {_stage_config(args)}, batch {BATCH}, {MICROBATCHES} microbatches, GPipe, 2 stages of 1 device")
        figures.append(sections[name](args))
    print("RESULT " + " ".join(figures))


if __name__ == "__main__":
    main()

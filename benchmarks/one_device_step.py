"""Predicted against measured step time of a 1B-class model on this machine's
accelerator (the host's CPU left out): the check of the estimator that needs a real GPU.

The model is `models.llama.TINYLLAMA_1B` (TinyLlama-1.1B's shapes with full multi-head
attention, 1024 tokens a sequence, bf16 compute, f32 parameters, AdamW), `--batch-size`
sequences a step. Its distinct layers are profiled here as a user would
(`hetpar profile --layers models.llama:tinyllama_1b`: the device's matmul throughput,
memory bandwidth and launch cost, then each layer's forward, backward and update at
the examples per device the plan runs). The planner then plans the step for one device
twice, priced from the device catalog alone and from that profile; each plan is run
and timed (wall clock, each call blocked on, after a compiling call and
`--warmup` more; the median of `--repeats`), and its prediction
(`Plan.predicted_step_time_s`, the one estimator's) compared with the measurement.

With `--small` a tiny Llama of the same code runs instead, on any machine (the path
alone: its figures say nothing of a GPU's).

On an H100 (2026-11-27) the profile took 81 s at 4 sequences (65 s at 2), most of it
compiling; the two planned steps another 70 s. `--profile-only --profile $OUT/layers.json`
then `--profile layers.json` splits it into two calls (an existing file is used as it
is); `-v` logs each phase with its time.

Ends with
RESULT device=<type> measured_s=<t> profile_s=<t> profile_err=<x> catalog_s=<t> catalog_err=<x>
(errors: predicted over measured, less one).
Run: .venv/bin/python benchmarks/one_device_step.py [--batch-size 4] [--profile F [--profile-only]] [--small] [-v]
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

import hetpar  # noqa: E402
from hetpar.cli import main as cli  # noqa: E402
from models import llama  # noqa: E402
from step_timing import step_times  # noqa: E402

SMALL = llama.LlamaConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4, d_ff=256)


def small(batch_size: int = 8) -> llama.Workload:
    """A tiny Llama of the same code, for `--small` (a module-level factory, so that
    `hetpar profile --layers` can name it)."""
    return llama.setup(batch_size, SMALL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="a tiny Llama: the path alone, on any machine")
    parser.add_argument("--profile", help="the layer profile: used if the file exists, else made there")
    parser.add_argument("--profile-only", action="store_true", help="make the profile (--profile) and stop")
    parser.add_argument("--rounds", type=int, default=3, help="the profile's timed rounds per program")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the profile's and the planner's progress, timed")
    args = parser.parse_args()
    if args.verbose:  # force: an import may have set up logging already; the CLI then keeps this one
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    if args.profile_only and not args.profile:
        parser.error("--profile-only needs --profile FILE to write")
    factory = small if args.small else llama.tinyllama_1b
    spec = f"{Path(__file__).resolve()}:small" if args.small else "models.llama:tinyllama_1b"
    device = jax.devices()[0]
    cluster = hetpar.Cluster.local(include_cpu=False)
    print(f"device: {device.device_kind} ({device.platform}); cluster: {cluster.describe()}", flush=True)

    profile = Path(args.profile) if args.profile else Path(tempfile.mkdtemp()) / "layers.json"
    if not profile.exists():
        started = time.perf_counter()
        per_device = str(args.batch_size)  # the plan for one device runs the whole batch on it, one microbatch
        if cli(["-v"] * args.verbose + ["profile", "--layers", spec, "--microbatch-sizes", per_device,
                                        "--rounds", str(args.rounds), "-o", str(profile)]) != 0:
            raise SystemExit("hetpar profile --layers failed; its message is above")
        print(f"profiled in {time.perf_counter() - started:.0f} s", flush=True)
        gc.collect()  # the profile's programs and their inputs, before the model is made again
    if args.profile_only:
        return

    rows = {}
    for label, source in (("catalog", None), ("profile", profile)):
        w = factory(args.batch_size)
        step = hetpar.parallelize(w.step, cluster=cluster, profile=source)
        started = time.perf_counter()
        times = step_times(step, w.state, w.batch, args.repeats, warmup=args.warmup)
        plan = step.plan
        measured = statistics.median(times)
        rows[label] = (plan.predicted_step_time_s, measured)
        print(f"{label:>8}: predicted {plan.predicted_step_time_s * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms "
              f"(median of {len(times)}, {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}; {time.perf_counter() - started:.0f} s "
              f"with compiling), {plan.predicted_step_time_s / measured - 1:+.1%}", flush=True)
        print(plan, flush=True)
        del step, w
        gc.collect()

    measured = rows["profile"][1]
    print(f"RESULT device={device.device_kind.replace(' ', '_')} measured_s={measured:.4f} "
          f"profile_s={rows['profile'][0]:.4f} profile_err={rows['profile'][0] / measured - 1:+.3f} "
          f"catalog_s={rows['catalog'][0]:.4f} catalog_err={rows['catalog'][0] / rows['catalog'][1] - 1:+.3f}")


if __name__ == "__main__":
    main()

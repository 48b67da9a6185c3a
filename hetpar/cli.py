"""The `hetpar` command line.

    hetpar devices                 the device catalog
    hetpar profile -o profile.json [--model gpt]
                                   measure this machine's devices (and a model's layers) for the predictor
"""

from __future__ import annotations

import argparse
import logging
import sys

from hetpar.errors import HetparError


def _devices(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from hetpar.cluster.catalog import devices

    table = Table(title="hetpar device catalog (dense peaks)")
    for col in ("type", "vendor", "fp32 TF", "tf32 TF", "bf16 TF", "memory GiB", "HBM GB/s", "node link GB/s"):
        table.add_column(col, justify="left" if col in ("type", "vendor") else "right")
    for d in devices():
        table.add_row(
            d.name, d.vendor,
            f"{d.flops('fp32') / 1e12:.1f}", f"{d.flops('tf32') / 1e12:.1f}", f"{d.flops('bf16') / 1e12:.1f}",
            f"{d.memory_bytes / 2**30:.0f}", f"{d.memory_bandwidth / 1e9:.0f}", f"{d.intra_node_link.bandwidth / 1e9:.0f}",
        )
    Console().print(table)
    if args.sources:
        for d in devices():
            print(f"{d.name}: {d.source}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    import jax

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    from hetpar.predict.profile import LayerWorkload, profile_local
    from hetpar.workloads import load_workload

    layers = []
    if args.model:
        for size in _ints(args.batch_sizes, "--batch-sizes"):
            w = load_workload(args.model, batch_size=size)
            layers.append(LayerWorkload(f"{args.model} batch {size}", w.step, w.args, args.layers))
    profile = profile_local(mesh_size=args.mesh_size, device_type=args.device_type, layers=layers)
    profile.save(args.output)
    for name, d in profile.devices.items():
        c = d.compute
        print(
            f"{name}: {d.mesh_size} device(s), matmul {c.matmul_flops / 1e9:.1f} GFLOP/s per device "
            f"(half speed at {c.half_flops / 1e6:.2f} MFLOP), memory {c.memory_bandwidth / 1e9:.2f} GB/s, "
            f"launch {c.program_overhead_s * 1e6:.0f} us, all-reduce {d.allreduce_bandwidth / 1e9:.2f} GB/s "
            f"+ {d.allreduce_latency_s * 1e6:.1f} us/step"
        )
        if d.layer_samples:
            print(
                f"  calibrated on {len(d.layer_samples)} layer programs of {d.layer_model}: launch x{c.launch_scale:.2f}, "
                f"matmul x{c.matmul_scale:.2f}, vector x{c.vector_scale:.2f}, {c.op_overhead_s * 1e6:.1f} us per kernel"
            )
    print(f"wrote {args.output}")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise HetparError(f"{flag} takes comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise HetparError(f"{flag} needs positive numbers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetpar", description="Automatic parallelization for heterogeneous clusters.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("devices", help="list the device catalog: peak FLOP/s, memory, links")
    p.add_argument("--sources", action="store_true", help="also print where each figure comes from")
    p.set_defaults(run=_devices)

    p = sub.add_parser(
        "profile",
        help="measure this machine's devices (matmul throughput, memory bandwidth, launch cost, all-reduce) "
        "and write a profile the predictor uses instead of the catalog's figures",
    )
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile (JSON)")
    p.add_argument("--mesh-size", type=int, help="devices per measured mesh (default: all of a kind)")
    p.add_argument("--device-type", help="catalog name to file the measurement under (default: detected)")
    p.add_argument("--cpu-devices", type=int, help="on CPU, split the host into this many virtual devices")
    p.add_argument(
        "--model",
        help="also time this model's layers one by one and calibrate the predictor on them: "
        "a reference model (gpt, mlp) or MODULE:FUNCTION returning (step, args) or a workload",
    )
    p.add_argument("--batch-sizes", default="8,16", help="batch sizes to time the layers at (default 8,16)")
    p.add_argument("--layers", type=int, default=4, help="how many layers to cut the model into (default 4)")
    p.set_defaults(run=_profile)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.run(args)
    except HetparError as e:
        print(f"hetpar: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Commands about hardware: the device catalog, cluster files, and profiling."""

from __future__ import annotations

import argparse

from hetpar.cli.output import console
from hetpar.errors import HetparError


def devices(args: argparse.Namespace) -> int:
    from rich.table import Table

    from hetpar.cluster.catalog import devices as catalog

    table = Table(title="hetpar device catalog (dense peaks)")
    for col in ("type", "vendor", "fp32 TF", "tf32 TF", "bf16 TF", "fp8 TF", "memory GiB", "HBM GB/s", "node link GB/s"):
        table.add_column(col, justify="left" if col in ("type", "vendor") else "right")
    for d in catalog():
        table.add_row(
            d.name, d.vendor,
            f"{d.flops('fp32') / 1e12:.1f}", f"{d.flops('tf32') / 1e12:.1f}", f"{d.flops('bf16') / 1e12:.1f}",
            f"{d.peak_flops['fp8'] / 1e12:.1f}" if "fp8" in d.peak_flops else "-",
            f"{d.memory_bytes / 2**30:.0f}", f"{d.memory_bandwidth / 1e9:.0f}", f"{d.intra_node_link.bandwidth / 1e9:.0f}",
        )
    console().print(table)
    if args.sources:
        for d in catalog():
            print(f"{d.name}: {d.source}")
            for figure, where in d.sources:
                if figure not in ("datasheet", "url"):
                    print(f"    {figure}: {where}")
    return 0


def validate(args: argparse.Namespace) -> int:
    from rich.table import Table

    from hetpar.cluster.cluster import Cluster

    cluster = Cluster.from_file(args.cluster)
    table = Table(title=f"{args.cluster}: {cluster.num_devices} devices, valid")
    for col in ("group", "device", "nodes", "per node", "intra-node GB/s", "inter-node GB/s", "NICs/node", "usable GiB"):
        table.add_column(col, justify="left" if col in ("group", "device") else "right")
    for g in cluster.groups:
        intra = g.intra_cost()
        usable = g.spec.memory_bytes * g.client_memory().fraction - g.spec.process_reserve_bytes
        table.add_row(
            g.label, g.type_name, str(g.nodes), str(g.devices_per_node),
            f"{intra.bandwidth / 1e9:.1f}" + ("" if g.peer_to_peer else " (via host)"),
            f"{g.inter_link.bandwidth / 1e9:.1f}" if g.nodes > 1 else "-",
            (str(g.nics_per_node) if g.nics_per_node else "1/device") if g.nodes > 1 else "-",
            f"{usable / 2**30:.1f} ({g.client_memory().setting})",
        )
    console().print(table)
    for g in cluster.groups:
        for where, link in (("inside its nodes", g.intra_link), ("between its nodes", g.inter_link if g.nodes > 1 else None)):
            r = link.reduction if link is not None else None
            if r is not None:
                limit = f", messages up to {r.max_message / 2**20:,.0f} MiB per reduction" if r.max_message else ""
                print(f"{g.label}: in-network reduction {where}: {r.levels} switch level(s) of {r.latency * 1e6:g} us, "
                      f"{r.bandwidth / 1e9:.1f} GB/s per flow{limit}")
    groups = list(cluster.groups)
    for i, a in enumerate(groups):
        for b in groups[i + 1:]:
            link = cluster.link_between(a, b)
            print(f"{a.label} <-> {b.label}: {link.name}, {link.bandwidth / 1e9:.1f} GB/s, {link.latency * 1e6:.1f} us")
    return 0


def profile(args: argparse.Namespace) -> int:
    import jax

    if args.merge:
        return merge_profiles(args)
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.links:
        return profile_links(args)
    from hetpar.predict.profile import LayerWorkload, profile_local
    from hetpar.workloads import load_workload

    # The step's module first: it may set JAX's CPU device count, which only works
    # before anything (the device profile below) starts JAX's backend.
    step = load_workload(args.layers).abstract() if args.layers else None
    if args.layers:  # the layer profile's degrees checked before the device profile takes its time
        for flag in ("--microbatch-sizes", "--data-parallel", "--tensor-parallel"):
            ints(getattr(args, flag[2:].replace("-", "_")), flag)
    layers = []
    if args.model:
        for size in ints(args.batch_sizes, "--batch-sizes"):
            w = load_workload(args.model, batch_size=size)
            layers.append(LayerWorkload(f"{args.model} batch {size}", w.step, w.args, args.num_layers or 4))
    sizes = ints(args.mesh_sizes, "--mesh-sizes") if args.mesh_sizes else []
    result = profile_local(mesh_size=args.mesh_size, device_type=args.device_type, layers=layers, mesh_sizes=sizes,
                           include_cpu=args.host_cpu)
    if args.layers:
        result.layers = profile_layers(args, step)
    result.save(args.output)
    for name, d in result.devices.items():
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
                f"matmul x{c.matmul_scale:.2f}, vector x{c.vector_scale:.2f}, transposes x{c.transpose_scale:.2f}, {c.op_overhead_s * 1e6:.1f} us per kernel"
            )
        for size, m in d.meshes:
            print(f"  on {size} devices: matmul {m.matmul_flops / 1e9:.1f} GFLOP/s per device, launch x{m.launch_scale:.2f}, "
                  f"matmul x{m.matmul_scale:.2f}, vector x{m.vector_scale:.2f}, transposes x{m.transpose_scale:.2f}, {m.op_overhead_s * 1e6:.1f} us per kernel")
    print(f"wrote {args.output}")
    return 0


def profile_links(args: argparse.Namespace) -> int:
    """`hetpar profile --links`: each device kind's node links, as cluster-file fields."""
    from hetpar.cluster.cluster import jax_devices
    from hetpar.predict.links import measure_links
    from hetpar.predict.profile import profiled_groups

    for name, group in profiled_groups(args.device_type, args.host_cpu):
        if len(group.device_ids) < 2:
            print(f"# {name}: one device, no link between devices to measure")
            continue
        links = measure_links(jax_devices(group.device_ids), name)
        print(links.as_yaml())
    return 0


def ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise HetparError(f"{flag} takes comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise HetparError(f"{flag} needs positive numbers, got {text!r}")
    return values


def profile_layers(args: argparse.Namespace, workload) -> list:  # noqa: ANN001
    """`hetpar profile --layers STEP`: each distinct layer of STEP (`workload`, loaded)
    timed on every device kind of this process (predict/layer_profile.py), the host's
    CPU beside accelerators only with `--host-cpu`: a large model's layers, and the
    reference stage of nearly all of them, run many times slower on the host's cores."""
    import jax

    from hetpar.predict.layer_profile import layer_timing
    from hetpar.predict.profile import profiled_groups
    from hetpar.runtime.host_cost import host_runs
    from hetpar.shard import shard_stages

    records = []
    sizes = ints(args.microbatch_sizes, "--microbatch-sizes")
    for kind, group in profiled_groups(args.device_type, args.host_cpu):
        try:
            records += layer_timing(workload.step, workload.args, group.device_ids, kind, sizes,
                                    ints(args.data_parallel, "--data-parallel"),
                                    num_layers=args.num_layers, remat=not args.no_remat, host=host_runs,
                                    tensor_parallel=ints(args.tensor_parallel, "--tensor-parallel"),
                                    shard=shard_stages).measure(args.rounds)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            half = max(sizes) // 2
            fix = (f"profile smaller ones (--microbatch-sizes {half})" if half >= 2 else
                   "2 examples is the least a profile runs: profile on devices with more memory")
            raise HetparError(f"profiling {workload.name}'s layers ran out of {kind}'s memory at microbatch sizes "
                              f"{','.join(map(str, sizes))}: {fix}; XLA said: {str(e).splitlines()[0][:200]}") from e
    for r in records:
        sizes = ", ".join(f"{p.examples}: {p.forward_s * 1e3:.3g}/{p.backward_s * 1e3:.3g} ms" for p in r.points)
        mesh = f"{r.dp}x{r.tp} (data x model) {r.device_kind}" if r.tp > 1 else f"{r.dp}x{r.device_kind}"
        print(f"  layer {r.name} [{r.signature}] on {mesh} ({r.dtype}), fwd/bwd per examples {sizes}")
    return records


def merge_profiles(args: argparse.Namespace) -> int:
    """`hetpar profile --merge A B -o out`: profiles of other machines' device kinds as one file."""
    from hetpar.predict.profile import Profile

    merged = Profile.merge([(path, Profile.load(path)) for path in args.merge])
    merged.save(args.output)
    kinds = sorted(set(merged.devices) | {r.device_kind for r in merged.layers})
    print(f"wrote {args.output}: {', '.join(kinds) or 'nothing'} ({len(merged.layers)} layer records)")
    return 0

"""Commands about plans: solve one offline, look at it, simulate its schedule."""

from __future__ import annotations

import argparse

from hetpar.cli.output import console
from hetpar.errors import HetparError


def solve(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from hetpar.cluster.cluster import Cluster
    from hetpar.plan.file import save_plan
    from hetpar.options import ShardingOption, StageOption
    from hetpar.passes import announcing
    from hetpar.pipeline import make_plan
    from hetpar.workloads import load_workload

    cluster = Cluster.from_file(args.cluster)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task(f"building {args.function}", total=None)
        workload = load_workload(args.function, batch_size=args.batch_size)
        progress.update(task, description=f"tracing the step for {cluster.describe()}")
        with announcing(lambda what: progress.update(task, description=f"{what} ({cluster.describe()})")):
            plan = make_plan(workload.step, workload.args, cluster, num_microbatches=args.microbatches,
                             batch_argnum=args.batch_argnum, num_stages=args.stages, num_replicas=args.replicas,
                             num_layers=args.layers, schedule=args.schedule,
                             use_all_kinds=args.use_all_kinds, profile=args.profile, chunks=args.chunks,
                             sharding_option=ShardingOption(zero=args.zero, zero_group=getattr(args, "zero_group", None)),
                             stage_option=StageOption(time_limit_s=args.time_limit, finalists=args.finalists, offload={
                                 "host": "host", "nvme": "nvme", "none": ""}.get(getattr(args, "offload", None))))
    save_plan(plan, args.output)
    _print_plan(plan)
    print(f"wrote {args.output}")
    if args.compare or args.manual:
        from hetpar.compare import compare_plans

        rows = compare_plans(workload.step, workload.args, cluster, tuple(args.manual), num_microbatches=args.microbatches,
                             batch_argnum=args.batch_argnum, schedule=args.schedule, chunks=args.chunks,
                             num_layers=args.layers, solved=plan)
        _print_comparison(rows)
    return 0


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def _print_comparison(rows) -> None:  # noqa: ANN001
    """One table: each configuration's step time, tokens/s, MFU and memory per device."""
    from rich.table import Table

    from hetpar.plan import fmt_time

    table = Table(title="the planner's choice beside the alternatives (one cost model, simulated step)")
    for col in ("configuration", "plan", "step", "tokens/s", "MFU", "memory / device"):
        table.add_column(col, justify="left" if col in ("configuration", "plan") else "right")
    for row in rows:
        c = row.choice
        if c is None:
            table.add_row(row.label, f"[red]{row.error}[/red]", "-", "-", "-", "-")
            continue
        table.add_row(row.label, c.describe(), fmt_time(c.step_s), f"{c.tokens_per_s:,.0f}", f"{c.mfu:.1%}",
                      f"{_size(row.memory_bytes)} / {row.memory_capacity / 2**30:.0f} GiB")
    console().print(table)


def show(args: argparse.Namespace) -> int:
    from hetpar.plan.file import load_plan

    _print_plan(load_plan(args.plan), shardings=args.shardings)
    return 0


def simulate(args: argparse.Namespace) -> int:
    from hetpar.plan import fmt_time
    from hetpar.plan.file import load_plan
    from hetpar.timeline import closed_form_s, plot_timeline, simulate_plan, step_lines, sync_algorithms, write_chrome_trace

    plan = load_plan(args.plan)
    if args.schedule:
        from dataclasses import replace

        from hetpar.plan.costs import priced

        plan = priced(replace(plan, schedule=args.schedule))  # the price depends on the schedule
    try:
        sim = simulate_plan(plan)
    except ValueError as e:
        raise HetparError(str(e)) from None
    closed = closed_form_s(plan)
    print(f"simulated step ({plan.schedule}, {plan.num_microbatches} microbatches): " + "; ".join(step_lines(plan, sim)))
    print(f"planner's closed form: {fmt_time(closed)} ({(closed - sim.step_s) / sim.step_s:+.1%} from the simulation)")
    if args.trace:
        write_chrome_trace(sim, args.trace, sync_algorithms(plan))
        print(f"wrote {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    if args.plot:
        plot_timeline(plan, sim, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _host(stage) -> str:  # noqa: ANN001
    """A stage's host memory per device: its offloaded optimizer state, or '-' where it keeps it on the devices;
    for the NVMe tier, the host's staging buffers and the state's bytes on disk."""
    if not stage.offload:
        return "-"
    if stage.offload == "nvme":
        return f"{_size(stage.host_bytes) if stage.host_bytes else '-'} (nvme {_size(stage.nvme_bytes) if stage.nvme_bytes else '-'})"
    return f"{_size(stage.host_bytes)} ({stage.offload})" if stage.host_bytes else f"- ({stage.offload})"


def _print_plan(plan, shardings: bool = False) -> None:  # noqa: ANN001
    from rich.table import Table

    from hetpar.plan import fmt_time, spec_text
    from hetpar.timeline import simulate_plan, step_lines
    from solver.pipeline_sim import MAX_SIMULATED_MICROBATCHES

    out = console()
    table = Table(title=f"hetpar plan: {plan.num_stages} stage(s) on {plan.describe_devices()}, {plan.num_microbatches} microbatch(es), {plan.schedule}"
                  + (f", {plan.chunks} chunks per device group" if plan.chunks > 1 else ""))
    for col in ("stage", "replica", "layers", "modules", "device", "devices", "mesh", "DP x TP", "batch", "fwd/mb", "bwd/mb",
                "memory / capacity", "host memory"):
        table.add_column(col, justify="left" if col in ("modules", "device") else "right", no_wrap=col == "host memory")
    for s in plan.stages:
        memory = f"{_size(s.memory_bytes)} / {s.memory_capacity / 2**30:.1f} GiB" if s.memory_bytes else (
            f"- / {s.memory_capacity / 2**30:.0f} GiB" if s.memory_capacity else "-")
        table.add_row(
            plan.stage_label(s), str(s.replica), f"{s.layer_start}-{s.layer_end - 1}", s.layer_names, s.device_type, str(s.num_devices),
            "x".join(map(str, s.mesh_shape or (s.num_devices,))), f"{s.data_parallel or s.num_devices} x {s.tensor_parallel}" + (f", ZeRO-{s.zero}" if s.zero else "")
            + (f" in groups of {s.zero_group}" if s.zero and s.zero_group else ""),
            plan.rows_label(s) or f"{s.batch_share:.0%}", fmt_time(s.forward_s), fmt_time(s.backward_s), memory, _host(s),
        )
    out.print(table)
    specs = [(s.index, path, spec_text(spec)) for s in plan.stages for path, spec in s.param_specs]
    if specs and not shardings:
        kinds = sorted({spec for _, _, spec in specs})
        out.print(f"{len(specs)} parameter and optimizer-state arrays placed, shardings: {', '.join(kinds)} (hetpar show --shardings lists them)")
    elif specs:
        sharding = Table(title="parameter shardings")
        for col in ("stage", "parameter", "PartitionSpec"):
            sharding.add_column(col)
        for index, path, spec in specs:
            sharding.add_row(str(index), path, spec)
        out.print(sharding)
    if not plan.predicted_step_time_s:
        out.print("not priced: the plan has no cost inputs (written by hand, or by an older hetpar); solve it again to price it")
    else:
        lines = [f"predicted step time {fmt_time(plan.predicted_step_time_s)}"]
        if plan.num_microbatches <= MAX_SIMULATED_MICROBATCHES:
            lines += step_lines(plan, simulate_plan(plan))[1:]
        if plan.tokens_per_step:
            lines.append(f"{plan.tokens_per_s:,.0f} tokens/s")
        if plan.peak_flops:
            lines.append(f"MFU {plan.mfu:.1%}")
        if plan.bound_ratio is not None:
            lines.append(f"{plan.bound_ratio:.1%} of the cluster's upper bound")
        out.print("; ".join(lines))
    _print_collectives(plan)
    if plan.cost_inputs is not None:
        out.print("priced from: " + ", ".join(f"{k.name} {'measured (profile)' if k.measured else 'catalog'}"
                                             for k in plan.cost_inputs.kinds))
        for line in layer_sources(plan):
            out.print(line)
    for note in plan.notes:
        out.print(f"note: {note}")


def _print_collectives(plan) -> None:  # noqa: ANN001
    """The plan's collectives, each with the algorithm the estimator priced it with
    (the registry's fastest for its size and devices): one row per kind of
    collective, with the stages that run it."""
    from rich.table import Table

    from hetpar.plan import fmt_time
    from hetpar.plan.collectives import plan_collectives

    rows: dict[tuple, list] = {}
    for u in plan_collectives(plan):
        key = (u.purpose, u.collective, u.devices, u.algorithm)
        rows.setdefault(key, []).append(u)
    if not rows:
        return
    table = Table(title="collectives, one call each, with the algorithm the estimator chose")
    for col in ("stages", "moves", "collective", "devices", "message", "algorithm", "time"):
        table.add_column(col, justify="right" if col in ("devices", "message", "time") else "left")
    for (purpose, collective, devices, algorithm), uses in rows.items():
        stages = sorted({u.stage for u in uses if u.stage is not None})
        where = "replicas" if not stages else _ranges(stages)
        largest = max(uses, key=lambda u: u.nbytes)
        table.add_row(where, purpose, collective.replace("_", "-"), str(devices), _bytes(largest.nbytes), algorithm,
                      fmt_time(largest.seconds))
    console().print(table)


def _bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"


def layer_sources(plan) -> list[str]:  # noqa: ANN001
    """Per device kind the plan runs on (and tensor-parallel degree, where above 1):
    which of its layers are priced from a measured layer profile and which from the
    model (`hetpar profile --layers`; a stage is priced from records of its own
    tensor-parallel degree only)."""
    inputs = plan.cost_inputs
    if inputs is None or not inputs.measured_layers:
        return []
    measured: dict[str, set[int]] = {}
    modelled: dict[str, set[int]] = {}
    names = {}
    for s in plan.stages:
        kind = s.group or s.device_type
        name = names.setdefault((kind, s.tensor_parallel), kind if s.tensor_parallel == 1 else f"{kind} (tp {s.tensor_parallel})")
        have = {m.layer for m in inputs.measured_layers if m.kind == kind and m.tp == s.tensor_parallel}
        for layer in range(s.layer_start, s.layer_end):
            (measured if layer in have else modelled).setdefault(name, set()).add(layer)
    return [f"layers on {name}: measured (profile) {_ranges(sorted(measured.get(name, ())))}; "
            f"modelled {_ranges(sorted(modelled.get(name, ())))}" for name in names.values()]


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] as "0-2, 5"; "none" for none."""
    if not layers:
        return "none"
    out, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)

"""The `hetpar` command line.

    hetpar devices                  the device catalog
    hetpar validate cluster.yaml    check a cluster file, show its groups and links
    hetpar profile -o profile.json  measure this machine's devices (and a model's layers) for the predictor
    hetpar solve MODULE:FUNCTION --cluster cluster.yaml -o plan.json
                                    make a plan offline
    hetpar show plan.json           stages, meshes, predicted time, memory, MFU
    hetpar simulate plan.json       the step event by event: a trace and a timeline
    hetpar launch --cluster cluster.yaml -- python train.py
                                    one process per node of the cluster file, on jax.distributed
"""

from __future__ import annotations

import argparse
import logging
import sys

from hetpar.cli import launch, machines, plans
from hetpar.cli.options import check_options
from hetpar.errors import HetparError
from solver import schedules
from solver.planner.search import FINALISTS


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="hetpar", description="Automatic parallelization for heterogeneous clusters.")
    top.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser("devices", help="list the device catalog: peak FLOP/s, memory, links")
    p.add_argument("--sources", action="store_true", help="also print where each figure comes from")
    p.set_defaults(run=machines.devices)

    p = sub.add_parser("validate", help="check a cluster file (YAML) and show its groups and the links between them")
    p.add_argument("cluster", help="the cluster file")
    p.set_defaults(run=machines.validate)

    p = sub.add_parser(
        "profile",
        help="measure this machine's devices (matmul throughput, memory bandwidth, launch cost, all-reduce) "
        "and write a profile the predictor uses instead of the catalog's figures",
    )
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile (JSON)")
    p.add_argument("--mesh-size", type=int, help="devices per measured mesh (default: all of a kind)")
    p.add_argument("--mesh-sizes", default="",
                   help="CPU virtual devices: also calibrate meshes of these sizes, e.g. 2,4 (the host's cores are "
                   "split among a mesh's devices, and a plan's mesh is predicted from the calibration nearest its size)")
    p.add_argument("--device-type", help="catalog name to file the measurement under (default: detected)")
    p.add_argument("--cpu-devices", type=int, help="on CPU, split the host into this many virtual devices")
    p.add_argument(
        "--model",
        help="also time this model's layers one by one and calibrate the predictor on them: "
        "a reference model (gpt, mlp) or MODULE:FUNCTION returning (step, args) or a workload",
    )
    p.add_argument("--batch-sizes", default="8,16", help="batch sizes to time the layers at (default 8,16)")
    p.add_argument("--num-layers", type=int, help="how many layers to cut the model (--model) or the step (--layers) "
                   "into (default: 4 for --model; the planner's cut for --layers, one per repeated block plus the rest)")
    p.add_argument(
        "--layers", metavar="STEP",
        help="time each distinct layer of this step (a reference model, MODULE:FUNCTION or file.py:FUNCTION) "
        "on this machine: forward, backward with and without recomputation, and the update, at --microbatch-sizes "
        "examples per device on meshes of --data-parallel x --tensor-parallel devices; `hetpar solve --profile` then "
        "prices those layers from the measurement",
    )
    p.add_argument("--microbatch-sizes", default="2,4,8", help="with --layers: examples per device to time (default 2,4,8)")
    p.add_argument("--data-parallel", default="1",
                   help="with --layers: data-parallel degrees to time each layer on, e.g. 1,2,4 (default 1)")
    p.add_argument("--tensor-parallel", "--tp", default="1",
                   help="with --layers: tensor-parallel degrees to time each layer at, e.g. 1,2,4, crossed with "
                   "--data-parallel (meshes of more devices than a kind has are left out); above 1 each layer runs as the "
                   "sharding pass lays out a stage of it on a data x model mesh (default 1: stages with a model axis "
                   "are then priced from the model)")
    p.add_argument("--no-remat", action="store_true", help="with --layers: skip the recomputing backward")
    p.add_argument("--host-cpu", action="store_true", help="on a machine with accelerators: also profile the host's "
                   "CPU, a device kind the planner may give stages, under its own name whatever --device-type says "
                   "(default: the accelerators only; a large model's layers take many times longer on the CPU)")
    p.add_argument("--rounds", type=int, default=7, help="with --layers: timed rounds per program (the median is kept)")
    p.add_argument("--links", action="store_true",
                   help="measure this machine's links instead (device to device, device to host) and print them as "
                   "a cluster file's group fields (intra_node, peer_to_peer, host_bandwidth)")
    p.add_argument("--merge", nargs="+", default=[], metavar="PROFILE",
                   help="write the union of these profiles (made on machines with other device kinds; one per kind) "
                   "to -o, measuring nothing")
    p.set_defaults(run=machines.profile)

    p = sub.add_parser(
        "solve",
        help="make a plan offline for a step and a cluster file, and save it (no accelerator needed)",
        description="FUNCTION returns (step, args) or an object with .step, .state and .batch; args may be "
        "jax.ShapeDtypeStruct trees (jax.eval_shape), so large models need no memory to plan.",
    )
    p.add_argument("function", help="a reference model (gpt, mlp), MODULE:FUNCTION or path/to/file.py:FUNCTION")
    p.add_argument("--cluster", required=True, help="the cluster file (YAML)")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan (JSON)")
    p.add_argument("--batch-size", type=int, help="passed to FUNCTION as batch_size=")
    p.add_argument("--microbatches", type=int, help="microbatches per step (default: the planner's choice; "
                   "1 with --stages or --replicas)")
    p.add_argument("--stages", type=int, help="pipeline stages (default: the planner's choice)")
    p.add_argument("--layers", type=int, help="layers to cut the model into (default: one per stage)")
    p.add_argument("--schedule", choices=schedules.names(), help="default: the planner's choice")
    p.add_argument("--chunks", type=int, help="stages per device group under an interleaved schedule "
                   "(default: the planner's choice, or the schedule's default with --stages)")
    p.add_argument("--replicas", type=int, help="data-parallel pipelines, each taking a share of the batch by speed "
                   "(default: the planner's choice)")
    p.add_argument("--zero", type=int, help="ZeRO stage over every stage's data axis: 0 replicated state, 1 optimizer "
                   "state sharded, 2 + gradients, 3 + parameters (default: chosen per parameter, by memory)")
    p.add_argument("--zero-group", type=lambda v: v if v == "auto" else int(v), metavar="N|auto",
                   help="hybrid sharding: ZeRO over groups of N devices of each stage's data axis (a node's: e.g. 4), "
                   "replicated across the groups, so only one group-shard's gradient all-reduce crosses nodes; auto: a "
                   "node's where the estimator prices it faster (default: the whole data axis)")
    p.add_argument("--offload", choices=("host", "nvme", "none"), help="where every stage keeps its optimizer state "
                   "between steps: host (host memory, moved to the devices for the update), nvme (a file store on the "
                   "node's local disk, read and written around the update) or none (the devices); default: the planner "
                   "offloads a stage only where it fits no other way, to disk only where host memory is short")
    p.add_argument("--profile", help="a `hetpar profile` file: its measured figures price the device kinds it has, "
                   "in place of the catalog's")
    p.add_argument("--use-all-kinds", action="store_true", help="only plans that give every device kind of the cluster "
                   "work (without it the planner may leave a kind idle; the plan's notes then say what using it costs)")
    p.add_argument("--batch-argnum", type=int, default=1, help="which argument of the step is the batch (default 1)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS", help="stop the planner's search after this long and "
                   "keep the best plan found; its notes say how far from the best possible it may be "
                   "(default: search until the best is proven)")
    p.add_argument("--finalists", type=int, metavar="N", help="the search's best plans by its closed form that the "
                   f"estimator then ranks (default {FINALISTS}); more where the closed form may misjudge the plan the "
                   "estimator would prefer, at a longer search")
    p.add_argument("--manual", action="append", default=[], metavar="SPEC",
                   help="price a configuration fixed by hand beside the planner's, e.g. "
                   "tp=8,pp=8,dp=4,mb=1,schedule=interleaved,chunks=2,remat=full[,kind=GROUP] (repeatable; implies --compare)")
    p.add_argument("--compare", action="store_true",
                   help="print the planner's choice beside the --manual configurations and the best plan on each "
                   "device kind alone: step time, tokens/s, MFU, memory per device")
    p.set_defaults(run=plans.solve)

    p = sub.add_parser("show", help="print a plan: stages, meshes, shardings, predicted time, memory, MFU")
    p.add_argument("plan", help="the plan file (JSON)")
    p.add_argument("--shardings", action="store_true", help="list every parameter's stage and PartitionSpec")
    p.set_defaults(run=plans.show)

    p = sub.add_parser("simulate", help="simulate one step of a plan event by event; write a trace and a timeline")
    p.add_argument("plan", help="the plan file (JSON)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace (JSON) here")
    p.add_argument("--plot", help="write a PNG timeline here")
    p.add_argument("--schedule", choices=schedules.names(), help="simulate another schedule than the plan's")
    p.set_defaults(run=plans.simulate)

    p = sub.add_parser(
        "launch",
        help="run a script as one process per node of a cluster file, joined by jax.distributed (on this machine: "
        "each process gets the node's devices as virtual CPU devices); a failing process stops them all",
    )
    p.add_argument("--cluster", required=True, help="the cluster file (YAML): one process per node of each group")
    p.add_argument("--timeout", type=float, help="stop the job after this many seconds (default: no limit)")
    p.add_argument("--port", type=int, help="the coordinator's port on this machine (default: a free one)")
    p.add_argument("--elastic", action="store_true", help="when a process is lost, start the job again on the nodes "
                   "that are left (the script plans for hetpar.launched_cluster() and resumes from its latest "
                   "checkpoint); after an error, start it again on the same nodes")
    p.add_argument("--max-restarts", type=int, default=3, help="with --elastic: how many times (default 3)")
    p.add_argument("--plan", help="the plan the script runs (JSON): the processes get the collective library's settings "
                   "for the algorithms it uses (NCCL's CollNet/SHARP switches for an in-network all-reduce); without "
                   "it, those for every algorithm the cluster file's fabric offers")
    p.add_argument("--ray", action="store_true", help="place the processes with Ray, one actor per node reserving its "
                   "GPUs (a local Ray instance unless --address)")
    p.add_argument("--address", help="the Ray cluster to use (implies --ray), e.g. head:6379")
    p.add_argument("--virtual", action="store_true", help="with --ray: reserve no accelerators; each process gets its "
                   "node's devices as virtual CPU devices (CPU-only Ray clusters, tests)")
    p.add_argument("command_line", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- python train.py")
    p.set_defaults(run=launch.launch)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        check_options(args)  # options.py: every flag's type and range, output paths writable
        return args.run(args)
    except HetparError as e:
        print(f"hetpar: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("hetpar: interrupted", file=sys.stderr)
        return 130

"""`hetpar launch`: run a training script as one process per host of a cluster file."""

from __future__ import annotations

import argparse

from hetpar.errors import HetparError


def launch(args: argparse.Namespace) -> int:
    from hetpar.cluster.cluster import Cluster
    from hetpar.runtime.launcher import launch_local, main_command
    from hetpar.runtime.ray_launcher import launch_ray

    command = list(args.command_line)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise HetparError("hetpar launch needs the command to run after '--', e.g. "
                          "hetpar launch --cluster cluster.yaml -- python train.py")
    if args.timeout is not None and args.timeout <= 0:
        raise HetparError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    cluster = Cluster.from_file(args.cluster)
    collective_env = _collective_env(cluster, args.plan)
    if args.port is not None and (args.ray or args.address):
        raise HetparError("--port is for local launches; a Ray launch picks its coordinator port on the head node")
    if args.max_restarts < 0:
        raise HetparError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if args.elastic and (args.ray or args.address):
        raise HetparError("--elastic is for local launches for now; under Ray, restart the job from its checkpoint")
    if args.elastic:
        from hetpar.runtime.elastic import launch_elastic

        launch_elastic(args.cluster, main_command(command), max_restarts=args.max_restarts, timeout_s=args.timeout,
                       port=args.port, collective_env=collective_env)
        return 0
    if args.ray or args.address:
        launch_ray(cluster, main_command(command), address=args.address, virtual=args.virtual, timeout_s=args.timeout,
                   collective_env=collective_env)
    else:
        if args.virtual:
            raise HetparError("--virtual is for --ray: local launches always use virtual CPU devices")
        launch_local(cluster, main_command(command), timeout_s=args.timeout, port=args.port, cluster_file=args.cluster,
                     collective_env=collective_env)
    return 0


def _collective_env(cluster, plan_file: str | None) -> dict[str, str]:  # noqa: ANN001
    """The collective library's settings for the plan's algorithms, or (no plan) for
    every algorithm the cluster's fabric offers (hetpar/plan/collectives.py)."""
    from hetpar.plan.collectives import cluster_environment, plan_environment

    if plan_file is None:
        return cluster_environment(cluster)
    from hetpar.plan.file import load_plan

    return plan_environment(load_plan(plan_file))

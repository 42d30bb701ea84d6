"""``mlx-train train --distributed``: launch the training on the cluster under the supervisor.

The launching process resolves the configuration once and writes it to
``<run_dir>/distributed/launch-config.yaml``; every rank then runs
``python -m mlx_train train --config <that file>`` (a ``DistributedTrainer``, because the
supervisor's environment says it is a rank). Hosts: ``--hostfile FILE``, else the configured
cluster (``mlx-train configure --distributed``), else ``-n N`` processes on 127.0.0.1. ``-n`` is
always the total number of processes: with a host file or cluster (one entry per rank) it must
equal its number of entries or a multiple of it (each entry then runs that many ranks).

Example::

    mlx-train train --distributed -n 2 --max-steps 100 --max-restarts 2
    mlx-train train --distributed -n 2 --strategy tensor_parallel --model transformer --dataset text
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlx_train import rundir

if TYPE_CHECKING:
    from mlx_train.distributed.hostfile import Hostfile

DEFAULT_HEARTBEAT_TIMEOUT = 30.0  # seconds; the rank monitor writes every 0.5 s


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` flags of distributed runs (``--max-restarts`` is a TrainConfig flag)."""
    parser.add_argument("--distributed", action="store_true",
                        help="launch the training with mlx.launch on the configured cluster (mlx-train configure "
                        "--distributed), or on -n N local processes when none is configured, under a supervisor "
                        "that restarts the group from the last checkpoint when a rank dies or hangs")
    parser.add_argument("-n", "--num-processes", type=int, default=None, metavar="N",
                        help="with --distributed: the total number of processes; N on 127.0.0.1 when no cluster "
                        "is configured (default 2); with a cluster or --hostfile, its number of entries (the "
                        "default) or a multiple of it")
    parser.add_argument("--hostfile", default=None, metavar="FILE",
                        help="with --distributed: launch on the hosts of this mlx.launch host file instead of "
                        "the configured cluster")
    add_strategy_argument(parser)
    parser.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT, metavar="SECONDS",
                        help="with --distributed: restart the group from the last checkpoint when a rank's heartbeat "
                        "(written by a background thread, also during validation and checkpoints) stops for this "
                        f"long, e.g. a frozen process (default {DEFAULT_HEARTBEAT_TIMEOUT:g})")


def add_strategy_argument(parser: argparse.ArgumentParser, when: str = "with --distributed") -> None:
    """``--strategy``, one flag for every command that takes it (train, finetune, optimize): its choices and
    help are the ``distributed_strategy`` field's; ``when`` says when it applies.

    Example: ``add_strategy_argument(parser, "the split the plan is for")``
    """
    from mlx_train.config import TrainConfig

    strategy = TrainConfig.fields_help()["distributed_strategy"]  # help and choices: the config field's
    parser.add_argument("--strategy", default=None, choices=strategy.choices,
                        help=f"{when}: {strategy.help} (default {strategy.default})")


def cluster_for(num_processes: int | None, hostfile: str | None, backend: str) -> Hostfile:
    """The ``Hostfile`` a distributed run launches on (see the module docstring)."""
    from mlx_train.distributed.config import load_cluster
    from mlx_train.distributed.hostfile import Hostfile
    from mlx_train.errors import ConfigError

    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"-n must be at least 1, got {num_processes}")
    cluster = Hostfile.read(hostfile) if hostfile else load_cluster()
    if cluster is None:
        cluster = Hostfile.local(num_processes or 2, backend)
    elif num_processes is not None and num_processes != cluster.num_processes:
        entries = cluster.num_processes
        if num_processes % entries:
            source, change = (f"host file {hostfile}", "edit the host file") if hostfile else (
                f"the configured cluster ({cluster.path})", "reconfigure with 'mlx-train configure --distributed'")
            raise ConfigError(
                f"-n {num_processes} does not match {source}, which has {entries} entr{'ies' if entries != 1 else 'y'} "
                f"(one per rank): -n is the total number of processes; leave -n out to use {entries}, give a "
                f"multiple of {entries} to run several ranks per entry, or {change}")
        cluster.hosts = [host for host in cluster.hosts for _ in range(num_processes // entries)]
    if backend != "auto":
        cluster.backend = backend
    return cluster


def refuse_held_run(run_dir: str | os.PathLike[str], checkpoint_dir: str | None) -> None:
    """Raise CheckpointError while another process holds the run in ``run_dir``: a supervisor or rank of this
    machine recorded for it (a rank whose supervisor was killed finishes its step, saves and exits on its own),
    or a process holding its locks. Nothing is launched or written before this check.

    Example: ``refuse_held_run("runs/a", "runs/a/checkpoints")`` raises while a run trains in runs/a.
    """
    from mlx_train.distributed import registry
    from mlx_train.errors import CheckpointError
    from mlx_train.run_directory import RunDirectory

    here, entries = os.path.realpath(run_dir), registry.entries()
    supervisors = {e.get("run_id"): e for e in entries if e.get("kind") == "supervisor" and e["alive"]}
    for entry in sorted(entries, key=lambda e: e.get("kind") != "supervisor"):  # the supervisor says the most
        if not entry["alive"] or entry.get("pid") == os.getpid() or not entry.get("run_dir") \
                or os.path.realpath(entry["run_dir"]) != here:
            continue
        pid = entry["pid"]
        if entry.get("kind") == "supervisor":
            raise CheckpointError(
                f"run directory {run_dir} is held by another process: pid {pid}, the supervisor of a distributed run "
                f"on it. Wait for that run to end, or stop it (kill -TERM {pid}: its ranks save a checkpoint first) "
                "and resume then")
        if entry.get("kind") == "rank":
            supervisor = supervisors.get(entry.get("run_id"))
            whose = (f"its supervisor pid {supervisor['pid']} still runs" if supervisor else
                     "its supervisor is gone, so it finishes its current step, saves a checkpoint and exits")
            raise CheckpointError(
                f"run directory {run_dir} is held by another process: pid {pid}, rank {entry.get('rank')} of a "
                f"distributed run on it ({whose}). Resume once it has exited; 'mlx-train status' shows it, "
                "'mlx-train reset-distributed' stops it at once")
    RunDirectory.of(run_dir, checkpoint_dir).refuse_if_held()


def train_distributed(args: argparse.Namespace, config: Any, log: Callable[[str], None] = print,
                      command_name: str = "train") -> int:
    """Run ``mlx-train train --distributed`` (or ``command_name``: ``finetune``) with the parsed ``args`` and
    resolved ``config``; every rank runs that subcommand with the resolved config."""
    from mlx_train.errors import TrainingInterrupted
    from mlx_train.launch.supervisor import RecoveryPolicy, Supervisor

    if getattr(args, "strategy", None):
        config = config.replace(distributed_strategy=args.strategy)
    hosts = cluster_for(args.num_processes, args.hostfile, config.distributed_backend)
    run_dir = rundir.choose_run_dir(config, args.resume)
    refuse_held_run(run_dir, config.checkpoint_dir)
    config = config.replace(run_dir=str(run_dir),
                            checkpoint_dir=rundir.checkpoints_path(run_dir, config.checkpoint_dir))
    state_dir = rundir.distributed_dir(run_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    config_path = state_dir / rundir.LAUNCH_CONFIG_FILE
    config.to_yaml(str(config_path))
    python = hosts.python or sys.executable
    command = [python, "-m", "mlx_train", command_name, "--config", str(config_path.resolve())]
    if args.resume:
        command += ["--resume", args.resume]
    world = hosts.num_processes
    if config.distributed_strategy == "tensor_parallel":
        log(f"distributed run: tensor parallel over {world} process{'es' if world != 1 else ''} (each holds 1/{world} "
            f"of every split layer), global batch {config.batch_size * config.gradient_accumulation}; run directory "
            f"{run_dir}")
    else:
        log(f"distributed run: {world} process{'es' if world != 1 else ''} x batch {config.batch_size} x "
            f"accumulation {config.gradient_accumulation} = global batch "
            f"{world * config.batch_size * config.gradient_accumulation}; run directory {run_dir}")
    policy = RecoveryPolicy.from_collective_timeout(
        config.max_restarts, config.collective_timeout,
        frozen_timeout=DEFAULT_HEARTBEAT_TIMEOUT if getattr(args, "heartbeat_timeout", None) is None
        else args.heartbeat_timeout)
    supervisor = Supervisor(command, hosts, run_dir, policy, config.checkpoint_dir, restart_args=["--resume", "auto"])
    try:
        result = supervisor.run()
    except TrainingInterrupted as stop:  # the ranks saved a checkpoint at one step: say how to go on
        hostfile = f" --hostfile {args.hostfile}" if args.hostfile else ""
        print(f"to continue: mlx-train {command_name} --distributed -n {world}{hostfile} --run-dir {run_dir} --resume",
              file=sys.stderr)
        return stop.code if isinstance(stop.code, int) else 1  # 128 + signal, as schedulers expect
    restarts = len(result.restarts)
    log(f"distributed run finished in {result.seconds:.1f} s with {restarts} restart{'s' if restarts != 1 else ''}"
        + (f" ({'; '.join(r.cause for r in result.restarts)})" if restarts else ""))
    return 0

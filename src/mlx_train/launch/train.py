"""``mlx-train train --distributed``: launch the training on the cluster under the supervisor.

The launching process resolves the configuration once and writes it to
``<run_dir>/distributed/launch-config.yaml``; every rank then runs
``python -m mlx_train train --config <that file>`` (a ``DistributedTrainer``, because the
supervisor's environment says it is a rank). Hosts: ``--hostfile FILE``, else the configured
cluster (``mlx-train configure --distributed``), else ``-n N`` processes on 127.0.0.1.

Example::

    mlx-train train --distributed -n 2 --max-steps 100 --max-restarts 2
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mlx_train import rundir


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` flags of distributed runs (``--max-restarts`` is a TrainConfig flag)."""
    parser.add_argument("--distributed", action="store_true",
                        help="launch the training with mlx.launch on the configured cluster (mlx-train configure "
                        "--distributed), or on -n N local processes when none is configured, under a supervisor "
                        "that restarts the group from the last checkpoint when a rank dies or hangs")
    parser.add_argument("-n", "--num-processes", type=int, default=None, metavar="N",
                        help="with --distributed: N processes on 127.0.0.1 when no cluster is configured "
                        "(default 2), N processes per host with a cluster")
    parser.add_argument("--hostfile", default=None, metavar="FILE",
                        help="with --distributed: launch on the hosts of this mlx.launch host file instead of "
                        "the configured cluster")


def cluster_for(num_processes: int | None, hostfile: str | None, backend: str):
    """The ``Hostfile`` a distributed run launches on (see the module docstring)."""
    from mlx_train.distributed.config import load_cluster
    from mlx_train.distributed.hostfile import Hostfile

    if num_processes is not None and num_processes < 1:
        from mlx_train.errors import ConfigError

        raise ConfigError(f"-n must be at least 1, got {num_processes}")
    cluster = Hostfile.read(hostfile) if hostfile else load_cluster()
    if cluster is None:
        cluster = Hostfile.local(num_processes or 2, backend)
    elif num_processes and num_processes > 1:
        cluster.hosts = [host for host in cluster.hosts for _ in range(num_processes)]
    if backend != "auto":
        cluster.backend = backend
    return cluster


def train_distributed(args: argparse.Namespace, config: Any, log=print) -> int:
    """Run ``mlx-train train --distributed`` with the parsed ``args`` and resolved ``config``."""
    from mlx_train.launch.supervisor import RecoveryPolicy, Supervisor

    hosts = cluster_for(args.num_processes, args.hostfile, config.distributed_backend)
    run_dir = rundir.choose_run_dir(config, args.resume)
    config = config.replace(run_dir=str(run_dir),
                            checkpoint_dir=config.checkpoint_dir or str(run_dir / rundir.CHECKPOINTS_DIR))
    state_dir = rundir.distributed_dir(run_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    config_path = state_dir / rundir.LAUNCH_CONFIG_FILE
    config.to_yaml(str(config_path))
    python = hosts.python or sys.executable
    command = [python, "-m", "mlx_train", "train", "--config", str(config_path.resolve())]
    if args.resume:
        command += ["--resume", args.resume]
    world = hosts.num_processes
    log(f"distributed run: {world} process{'es' if world != 1 else ''} x batch {config.batch_size} x accumulation "
        f"{config.gradient_accumulation} = global batch {world * config.batch_size * config.gradient_accumulation}; "
        f"run directory {run_dir}")
    policy = RecoveryPolicy.from_collective_timeout(config.max_restarts, config.collective_timeout)
    supervisor = Supervisor(command, hosts, run_dir, policy, config.checkpoint_dir, restart_args=["--resume", "auto"])
    result = supervisor.run()
    restarts = len(result.restarts)
    log(f"distributed run finished in {result.seconds:.1f} s with {restarts} restart{'s' if restarts != 1 else ''}"
        + (f" ({'; '.join(r.cause for r in result.restarts)})" if restarts else ""))
    return 0

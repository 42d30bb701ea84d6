"""Configure the machines a distributed run launches on.

Writes the cluster's host file (the format mlx.launch --hostfile reads) to
$MLX_TRAIN_HOME/cluster.json (default ~/.mlx-train/cluster.json), after checking that every
host can be reached: this machine (127.0.0.1) directly, the others by passwordless ssh.
OMPI_MCA_* settings of the current environment are recorded and sent to every rank (they
tune MPI's TCP transport; the ring backend ignores them).

Example::

    mlx-train configure --distributed --hosts 10.0.0.1,10.0.0.2
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from mlx_train.errors import ConfigError, DistributedError

EPILOG = """examples:
  mlx-train configure --distributed -n 2                          # 2 processes on this machine
  mlx-train configure --distributed --hosts 10.0.0.1,10.0.0.2     # two machines, one process each
  mlx-train configure --distributed --hostfile hosts.json --backend ring
  OMPI_MCA_btl_tcp_links=4 mlx-train configure --distributed --hosts mac1,mac2 --backend mpi
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mlx_train.config import BACKEND_CHOICES

    parser.add_argument("--distributed", action="store_true",
                        help="configure distributed training (the cluster's hosts and backend)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", metavar="A,B,...",
                       help="comma-separated IPs or host names, one process each; 127.0.0.1 (or localhost) is this "
                       "machine; names are resolved to IPs, which the ring backend needs")
    where.add_argument("--hostfile", metavar="FILE",
                       help="an existing mlx.launch host file to check and install, e.g. "
                       '[{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]')
    parser.add_argument("-n", "--num-processes", type=int, default=None, metavar="N",
                        help="processes per host (default 1); alone, N processes on this machine")
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default=None,
                        help="distributed backend: auto (the best this MLX has), ring, mpi, jaccl or nccl")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting sent to every rank, e.g. --env OMPI_MCA_btl_tcp_if_include=en0; repeatable")
    parser.add_argument("--python", default=None, metavar="PATH",
                        help="the Python the ranks run on every host (default: this one, at the same path)")
    parser.add_argument("--output", default=None, metavar="FILE",
                        help="where to write the host file (default: $MLX_TRAIN_HOME/cluster.json)")
    parser.add_argument("--no-check", action="store_true",
                        help="write the configuration without checking that the hosts can be reached")


def configure(hosts: str | None = None, hostfile: str | None = None, num_processes: int | None = None,
              backend: str | None = None, env: list[str] | None = None, output: str | None = None,
              check: bool = True, log: Callable[[str], None] = print) -> Any:
    """Build, check and write the cluster's host file; returns the ``Hostfile`` written.

    Raises ``DistributedError`` naming each unreachable host (nothing is written then).
    """
    from mlx_train.distributed.backends import choose_backend
    from mlx_train.distributed.config import cluster_path
    from mlx_train.distributed.hostfile import Hostfile
    from mlx_train.launch.network import check_hosts

    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"-n must be at least 1, got {num_processes}")
    if hosts is not None and not hosts.strip():
        raise ConfigError("--hosts is empty: list the machines, e.g. --hosts 10.0.0.1,10.0.0.2 (127.0.0.1 is this "
                          "machine), or leave --hosts out to configure processes on this machine only (-n N)")
    if hostfile:
        cluster = Hostfile.read(hostfile)
        if num_processes and num_processes > 1:
            cluster.hosts = [host for host in cluster.hosts for _ in range(num_processes)]
    elif hosts:
        cluster = Hostfile.from_hosts(hosts.split(","), repeat=num_processes or 1)
    else:
        cluster = Hostfile.local(num_processes or 1)
        log(f"no --hosts given: configuring {cluster.num_processes} process(es) on this machine (127.0.0.1); "
            "add machines with --hosts a,b,...")
    if backend:
        cluster.backend = backend
    recorded = [f"{k}={v}" for k, v in os.environ.items() if k.startswith("OMPI_MCA_")]
    for item in recorded + list(env or []):
        key = item.partition("=")[0]
        cluster.envs = [e for e in cluster.envs if e.partition("=")[0] != key] + [item]
    cluster.validate()
    choice = choose_backend(cluster.backend, cluster.has_rdma)
    if check:
        bad = [c for c in check_hosts(cluster) if not c.ok]
        if bad:
            raise DistributedError(
                f"{len(bad)} host{'s are' if len(bad) > 1 else ' is'} unreachable, nothing was written: "
                + "; ".join(f"{c.host.ssh}: {c.detail}" for c in bad)
                + ". Fix the host or its ssh access, remove it, or pass --no-check to write the configuration anyway"
            )
    path = cluster.write(output or cluster_path())
    log(f"wrote {path}: {cluster.num_processes} process{'es' if cluster.num_processes != 1 else ''}, "
        f"backend {cluster.backend} -> {choice}")
    for line in cluster.describe():
        log(f"  {line}")
    if cluster.envs:
        log(f"  settings sent to every rank: {' '.join(cluster.envs)}")
    log("next: mlx-train check-network, then mlx-train train --distributed")
    return cluster


def main(args: argparse.Namespace) -> int:
    if not args.distributed:
        raise ConfigError("nothing to configure: add --distributed (mlx-train configure --distributed --hosts a,b)")
    configure(args.hosts, args.hostfile, args.num_processes, args.backend, args.env, args.output,
              check=not args.no_check)
    return 0

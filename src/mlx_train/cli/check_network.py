"""Check the cluster's network: reach every host, then time each link between the ranks.

Runs a probe on every rank with mlx.launch on the backend training would use: for each pair
of neighbouring ranks, the latency and bandwidth of send/recv, and for the whole group the
all-reduce latency and bandwidth. Prints a table with a verdict per link (good, ok, slow,
failed). The hosts are those of --hosts/--hostfile, else the configured cluster, else -n N
processes on this machine. Exits with code 7 when a host is unreachable or a link failed.

Example::

    mlx-train check-network                 # the configured cluster
    mlx-train check-network -n 2            # two processes on 127.0.0.1
"""

from __future__ import annotations

import argparse

from mlx_train.errors import DistributedError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mlx_train.config import BACKEND_CHOICES

    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", metavar="A,B,...", help="comma-separated IPs or host names (default: the configured "
                       "cluster, else this machine)")
    where.add_argument("--hostfile", metavar="FILE", help="an mlx.launch host file")
    parser.add_argument("-n", "--num-processes", type=int, default=None, metavar="N",
                        help="with --hosts, processes per host; with a host file or the configured cluster, the total "
                        "(its number of entries or a multiple); alone, N processes on this machine (default 2)")
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default=None,
                        help="backend to measure (default: the cluster's)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="give up on the probe after this long (default 60)")
    parser.add_argument("--size-mb", type=float, default=8.0, metavar="MB",
                        help="message size for the bandwidth measurements (default 8)")


def main(args: argparse.Namespace) -> int:
    from mlx_train.distributed.hostfile import Hostfile
    from mlx_train.launch.network import check_network
    from mlx_train.launch.train import cluster_for

    if args.hosts:
        hostfile = Hostfile.from_hosts(args.hosts.split(","), repeat=args.num_processes or 1)
    else:
        hostfile = cluster_for(args.num_processes, args.hostfile, "auto")
    if args.backend:
        hostfile.backend = args.backend
    report = check_network(hostfile, timeout=args.timeout, message_bytes=int(args.size_mb * 2**20))
    print(report.table())
    if not report.ok:
        raise DistributedError(report.problem or "a link failed (see the table above)")
    return 0

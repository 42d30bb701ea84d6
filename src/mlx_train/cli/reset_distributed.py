"""Reset distributed state: stop leftover processes of mlx-train runs and clear stale records.

Only mlx-train's own processes are considered (supervisors and ranks it recorded, and processes
its supervisor started); a leftover is one whose supervisor or launcher is gone, or that has
recorded a failure. Each process stopped and each record removed is named. An invalid cluster
configuration is moved aside; --clear-config removes a valid one too. With --cluster the same
runs on every other host of the configured cluster, over ssh.

Example::

    mlx-train reset-distributed
    mlx-train reset-distributed --all --clear-config
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--all", dest="stop_running", action="store_true",
                        help="also stop distributed runs that are still running (their supervisors and ranks)")
    parser.add_argument("--clear-config", action="store_true",
                        help="also remove the cluster configuration written by mlx-train configure")
    parser.add_argument("--cluster", action="store_true",
                        help="also reset every other host of the configured cluster (over ssh)")


def reset_cluster_hosts(stop_running: bool, timeout: float = 30.0) -> list[str]:
    """Run ``reset-distributed`` on the configured cluster's remote hosts; one line per host."""
    from mlx_train.distributed.config import load_cluster

    cluster = load_cluster()
    if cluster is None:
        return ["no cluster configured: nothing to reset on other hosts"]
    lines = []
    python = cluster.python or sys.executable
    for ssh in dict.fromkeys(h.ssh for h in cluster.hosts if not h.is_local):
        command = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", ssh, python, "-m", "mlx_train",
                   "reset-distributed"] + (["--all"] if stop_running else [])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            output = (done.stdout + done.stderr).strip() or f"exit code {done.returncode}"
        except (OSError, subprocess.TimeoutExpired) as error:
            output = f"could not run over ssh: {error}"
        lines += [f"{ssh}: {line}" for line in output.splitlines()]
    return lines


def main(args: argparse.Namespace) -> int:
    from mlx_train.launch.reset import reset_distributed

    for line in reset_distributed(stop_running=args.stop_running, clear_config=args.clear_config):
        print(line)
    if args.cluster:
        for line in reset_cluster_hosts(args.stop_running):
            print(line)
    return 0

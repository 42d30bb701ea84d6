"""Launching distributed runs: the supervisor, the ``mlx.launch`` wrapper, network checks, reset.

- ``Supervisor`` / ``supervise``: launch a group, stop it when a rank dies or hangs, restart it from
  the last complete checkpoint up to ``max_restarts`` times.
- ``check_hosts``, ``check_network``, ``describe_cluster``, ``reset_distributed``: the CLI's cluster tools.

This layer sits above the rank runtime (``mlx_train.distributed``) and below the CLI.

Example::

    from mlx_train.launch import supervise
    supervise(["python", "train.py"], num_processes=2, run_dir="runs/a", checkpoint_dir="runs/a/ckpt")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

if TYPE_CHECKING:
    from mlx_train.launch.network import check_hosts, check_network
    from mlx_train.launch.reset import reset_distributed
    from mlx_train.launch.status import describe_cluster
    from mlx_train.launch.supervisor import RecoveryPolicy, Supervisor, supervise

_LAZY = {
    "Supervisor": "mlx_train.launch.supervisor",
    "RecoveryPolicy": "mlx_train.launch.supervisor",
    "supervise": "mlx_train.launch.supervisor",
    "check_hosts": "mlx_train.launch.network",
    "check_network": "mlx_train.launch.network",
    "describe_cluster": "mlx_train.launch.status",
    "reset_distributed": "mlx_train.launch.reset",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["RecoveryPolicy", "Supervisor", "check_hosts", "check_network", "describe_cluster",
           "reset_distributed", "supervise"]


"""Distributed training on ``mlx.core.distributed``, launched with ``mlx.launch``, under a supervisor.

- ``DistributedConfig``: devices x batch per device x accumulation, backend, recovery knobs.
- ``choose_backend`` / ``available_backends``: which backend, and why.
- ``Hostfile``: read, write and validate the host files ``mlx.launch`` takes.
- ``Supervisor`` / ``supervise``: launch a group, stop it when a rank dies or hangs, restart it from
  the last complete checkpoint up to ``max_restarts`` times.
- ``ParameterChecksum``: every K steps the ranks compare a checksum of their parameters.
- ``check_network``, ``describe_cluster``, ``reset_distributed``: the CLI's cluster tools.

Example::

    from mlx_train.distributed import supervise
    supervise(["python", "train.py"], num_processes=2, run_dir="runs/a", checkpoint_dir="runs/a/ckpt")
"""

from __future__ import annotations

# Loaded on first use, so that importing one part does not pull in the others.
_LAZY = {
    "DistributedConfig": "mlx_train.distributed.config",
    "cluster_path": "mlx_train.distributed.config",
    "load_cluster": "mlx_train.distributed.config",
    "available_backends": "mlx_train.distributed.backends",
    "choose_backend": "mlx_train.distributed.backends",
    "check_strategy": "mlx_train.distributed.backends",
    "Host": "mlx_train.distributed.hostfile",
    "Hostfile": "mlx_train.distributed.hostfile",
    "check_hosts": "mlx_train.distributed.hostfile",
    "Supervisor": "mlx_train.distributed.supervisor",
    "supervise": "mlx_train.distributed.supervisor",
    "RankMonitor": "mlx_train.distributed.rank",
    "ParameterChecksum": "mlx_train.distributed.checksum",
    "check_network": "mlx_train.distributed.network",
    "describe_cluster": "mlx_train.distributed.status",
    "reset_distributed": "mlx_train.distributed.reset",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mlx_train.distributed' has no attribute '{name}'")

"""The topologies and the distributed runtime: where a run's work is spread, and what each rank does, on
``mlx.core.distributed``.

- ``Topology``: what the Trainer asks of where its work is spread; ``Single`` (one process), ``DataParallel``,
  ``TensorParallel``, ``FSDP`` over a group (``init_group``).
- ``DistributedConfig``: devices x batch per device x accumulation, backend, recovery knobs.
- ``choose_backend`` / ``available_backends``: which backend, and why.
- ``Hostfile``: the host files ``mlx.launch`` takes (read, write, validate).
- ``RankMonitor``: a rank's heartbeat and collective watchdog; ``ParameterChecksum``: every K
  steps the ranks compare a checksum of their parameters.
- ``shard_model``: tensor parallelism (``mlx_train.distributed.tensor``; fine-tuning on a split model is
  ``mlx_train.llm.tensor_parallel``).

Launching a group (the supervisor, ``mlx.launch``, network checks, reset) is ``mlx_train.launch``,
and the Trainer is ``mlx_train.training``, layers above: this package imports neither.

Example::

    from mlx_train.distributed import DistributedConfig
    DistributedConfig(num_devices=4, batch_size_per_device=32).describe()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

# Loaded on first use, so that importing one part does not pull in the others.
if TYPE_CHECKING:
    from mlx_train.distributed.backends import available_backends, check_strategy, choose_backend
    from mlx_train.distributed.checksum import ParameterChecksum
    from mlx_train.distributed.config import DistributedConfig, cluster_path, load_cluster
    from mlx_train.distributed.hostfile import Host, Hostfile
    from mlx_train.distributed.rank import RankMonitor
    from mlx_train.distributed.tensor import shard_model
    from mlx_train.distributed.tensor_topology import TensorParallel
    from mlx_train.distributed.topology import FSDP, DataParallel, Single, Topology, init_group

_LAZY = {
    "DistributedConfig": "mlx_train.distributed.config",
    "cluster_path": "mlx_train.distributed.config",
    "load_cluster": "mlx_train.distributed.config",
    "available_backends": "mlx_train.distributed.backends",
    "choose_backend": "mlx_train.distributed.backends",
    "check_strategy": "mlx_train.distributed.backends",
    "Host": "mlx_train.distributed.hostfile",
    "Hostfile": "mlx_train.distributed.hostfile",
    "RankMonitor": "mlx_train.distributed.rank",
    "ParameterChecksum": "mlx_train.distributed.checksum",
    "shard_model": "mlx_train.distributed.tensor",
    "Topology": "mlx_train.distributed.topology",
    "Single": "mlx_train.distributed.topology",
    "DataParallel": "mlx_train.distributed.topology",
    "FSDP": "mlx_train.distributed.topology",
    "init_group": "mlx_train.distributed.topology",
    "TensorParallel": "mlx_train.distributed.tensor_topology",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["FSDP", "DataParallel", "DistributedConfig", "Host", "Hostfile", "ParameterChecksum", "RankMonitor",
           "Single", "TensorParallel", "Topology", "available_backends", "check_strategy", "choose_backend",
           "cluster_path", "init_group", "load_cluster", "shard_model"]


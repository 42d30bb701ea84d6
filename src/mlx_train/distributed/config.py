"""``DistributedConfig``: how many devices, the batch arithmetic, the backend and the recovery knobs.

Its knobs that ``TrainConfig`` also has are the same fields (``same_as``): one declaration of
each default, help text and constraint, in ``TrainConfig``'s data, training and distributed
sections; ``train_overrides()`` maps them back by name.

Example::

    config = DistributedConfig(num_devices=4, batch_size_per_device=32, gradient_accumulation=4)
    config.global_batch_size        # 512 samples per optimizer step
    config.describe()               # "4 devices x batch 32 x accumulation 4 = global batch 512; backend auto"
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_train.config import LaunchConfig, TrainConfig, option, same_as
from mlx_train.config.options import check_fields, options
from mlx_train.distributed.hostfile import Hostfile
from mlx_train.errors import ConfigError, DistributedError

CLUSTER_FILE = "cluster.json"


def _whole_devices(value: int, values: Mapping[str, Any]) -> str | None:
    return None if value >= 1 else f"must be an integer >= 1 (or None: as many as launched), got {value!r}"


@dataclass
class DistributedConfig:
    """A data-parallel run: ``num_devices`` processes, each training on ``batch_size_per_device``
    samples per micro-batch, ``gradient_accumulation`` micro-batches per optimizer step.

    The global batch is ``num_devices x batch_size_per_device x gradient_accumulation``; the
    DataLoader gives each rank its slice of every global batch, so the sample order does not
    depend on the number of devices. ``num_devices=None`` means as many as were launched.
    ``hosts``/``hostfile`` say where to launch (default: the configured cluster, else
    127.0.0.1); the other fields are ``TrainConfig`` fields (``batch_size_per_device`` is
    ``batch_size``, ``backend`` is ``distributed_backend``, ``strategy`` is ``distributed_strategy``:
    with ``"tensor_parallel"`` every process trains on the whole batch and a slice of the model).
    """

    num_devices: int | None = option(None, "Processes in the group (null: as many as were launched).",
                                     section="distributed", check=_whole_devices)
    batch_size_per_device: int = same_as(TrainConfig, "batch_size")
    gradient_accumulation: int = same_as(TrainConfig, "gradient_accumulation")
    backend: str = same_as(TrainConfig, "distributed_backend")
    strategy: str = same_as(TrainConfig, "distributed_strategy")
    hosts: list[str] | None = None
    hostfile: str | None = None
    max_restarts: int = same_as(LaunchConfig, "max_restarts")
    collective_timeout: float = same_as(TrainConfig, "collective_timeout")
    checksum_every: int | None = same_as(TrainConfig, "checksum_every")
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.hosts is not None and self.hostfile is not None:
            raise ConfigError("DistributedConfig: give hosts or hostfile, not both")

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all devices."""
        if self.num_devices is None:
            raise ConfigError("DistributedConfig.num_devices is not set, so the global batch is not known yet; "
                              "set num_devices or use global_batch_for(world_size)")
        return self.global_batch_for(self.num_devices)

    def global_batch_for(self, world_size: int) -> int:
        """Samples per optimizer step with ``world_size`` processes (tensor parallel ranks share each batch)."""
        ranks = 1 if self.strategy == "tensor_parallel" else world_size
        return ranks * self.batch_size_per_device * self.gradient_accumulation

    def train_overrides(self) -> dict[str, Any]:
        """The ``TrainConfig`` fields this config sets: ``TrainConfig().replace(**overrides)`` (max_restarts is
        the launcher's, ``LaunchConfig``'s: the supervisor reads it, the Trainer does not)."""
        return {f.metadata["same_as"][1]: getattr(self, name)
                for name, f in options(self).items() if f.metadata.get("same_as", ("",))[0] == "TrainConfig"}

    def check_world_size(self, world_size: int) -> None:
        """Raise ``DistributedError`` when the launched group does not have ``num_devices`` ranks."""

        if self.num_devices is not None and self.num_devices != world_size:
            raise DistributedError(
                f"DistributedConfig.num_devices is {self.num_devices} but {world_size} process"
                f"{'es were' if world_size != 1 else ' was'} launched: launch {self.num_devices} (mlx-train train "
                f"--distributed -n {self.num_devices}, or {self.num_devices} hosts), or set "
                f"num_devices={world_size} (the global batch becomes {self.global_batch_for(world_size)} instead "
                f"of {self.global_batch_size})"
            )

    def describe(self) -> str:
        """``4 devices x batch 32 x accumulation 4 = global batch 512; backend auto``"""
        if self.strategy == "tensor_parallel":
            devices = "N devices" if self.num_devices is None else str(self.num_devices)
            return (f"tensor parallel over {devices}: batch {self.batch_size_per_device} x accumulation "
                    f"{self.gradient_accumulation} = global batch {self.global_batch_for(1)}; backend {self.backend}")
        devices = "N devices" if self.num_devices is None else f"{self.num_devices} device" + (
            "s" if self.num_devices != 1 else "")
        total = "N x " + str(self.batch_size_per_device * self.gradient_accumulation) if self.num_devices is None \
            else str(self.global_batch_size)
        return (f"{devices} x batch {self.batch_size_per_device} x accumulation {self.gradient_accumulation} = "
                f"global batch {total}; backend {self.backend}")

    def resolve_hosts(self, num_processes: int | None = None) -> Hostfile:
        """The ``Hostfile`` to launch on: hosts, hostfile, the configured cluster, or 127.0.0.1 x N."""

        if self.hosts is not None:
            hostfile = Hostfile.from_hosts(self.hosts, self.backend, envs=_env_list(self.env))
        elif self.hostfile is not None:
            hostfile = Hostfile.read(self.hostfile)
        elif num_processes is None and cluster_path().exists():
            hostfile = Hostfile.read(cluster_path())
        else:
            hostfile = Hostfile.local(num_processes or self.num_devices or 2, self.backend)
        if self.backend != "auto":
            hostfile.backend = self.backend
        hostfile.envs = list(hostfile.envs) + [e for e in _env_list(self.env) if e not in hostfile.envs]
        return hostfile


def _env_list(env: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in env.items()]


def home() -> Path:
    """Where mlx-train keeps per-user state: ``$MLX_TRAIN_HOME`` or ``~/.mlx-train``."""
    return Path(os.environ.get("MLX_TRAIN_HOME") or Path.home() / ".mlx-train")


def cluster_path() -> Path:
    """The configured cluster's host file (written by ``mlx-train configure --distributed``)."""
    return home() / CLUSTER_FILE


def load_cluster() -> Hostfile | None:
    """The configured cluster's ``Hostfile``, or None when none is configured."""
    from mlx_train.distributed.hostfile import Hostfile

    path = cluster_path()
    return Hostfile.read(path) if path.exists() else None

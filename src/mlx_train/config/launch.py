"""``LaunchConfig``: the config of a command that may launch a group of processes -- the Trainer's
``TrainConfig`` plus what only the launcher and its supervisor read.

Example::

    LaunchConfig(max_restarts=0).max_restarts      # 0
    TrainConfig(max_restarts=0)                    # MisplacedSetting: a launcher setting, LaunchConfig's
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mlx_train.config.options import option
from mlx_train.config.sections import extends
from mlx_train.config.train import TrainConfig


@extends("launcher", "mlx-train train --distributed")
@dataclass
class LaunchConfig(TrainConfig):
    """The config of a command that may launch a group of processes (``mlx-train train``, ``finetune``): the
    Trainer's (``TrainConfig``) plus what only the launcher and its supervisor read. The number of processes
    and the hosts are the command's ``-n`` and ``--hostfile``.

    Example: ``LaunchConfig(max_restarts=0).max_restarts`` -> ``0``; ``TrainConfig(max_restarts=0)`` is an error.
    """

    placed_after: ClassVar[dict[str, str]] = {"max_restarts": "distributed_strategy"}

    max_restarts: int = option(3, "Times the supervisor of a distributed run restarts the whole group from "
                                  "the last complete checkpoint after a rank dies or hangs (0: never).",
                               section="distributed", minimum=0)



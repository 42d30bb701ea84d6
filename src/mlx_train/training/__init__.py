"""Training: the Trainer, the DataLoader and the callbacks.

Names load on first use (``mlx_train._lazy``): importing one module of this package (a callback, the
resume policy) does not load the Trainer and the rest of the training stack.

Example::

    from mlx_train.training import Trainer, DataLoader, ModelCheckpoint, EarlyStopping
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

if TYPE_CHECKING:
    from mlx_train.data.loader import DataLoader
    from mlx_train.training.callbacks import Callback, EarlyStopping, ModelCheckpoint, ReduceLROnPlateau
    from mlx_train.training.distributed import DistributedTrainer
    from mlx_train.training.ema import EMA
    from mlx_train.training.heartbeat import Heartbeat
    from mlx_train.training.loggers import MetricsLogger, ProgressBar
    from mlx_train.training.losses import CrossEntropyLoss
    from mlx_train.training.pruning import Pruning
    from mlx_train.training.tensorboard import TensorBoardLogger
    from mlx_train.training.trackers import MLflowLogger, WandbLogger
    from mlx_train.training.trainer import Trainer

_LAZY = {
    "DataLoader": "mlx_train.data.loader",
    # A Trainer with the topology of the launched group (the topologies sit below the training loop).
    "DistributedTrainer": "mlx_train.training.distributed",
    "Callback": "mlx_train.training.callbacks",
    "EarlyStopping": "mlx_train.training.callbacks",
    "ModelCheckpoint": "mlx_train.training.callbacks",
    "ReduceLROnPlateau": "mlx_train.training.callbacks",
    "EMA": "mlx_train.training.ema",
    "Heartbeat": "mlx_train.training.heartbeat",
    "MetricsLogger": "mlx_train.training.loggers",
    "ProgressBar": "mlx_train.training.loggers",
    "CrossEntropyLoss": "mlx_train.training.losses",
    "Pruning": "mlx_train.training.pruning",
    "TensorBoardLogger": "mlx_train.training.tensorboard",
    "MLflowLogger": "mlx_train.training.trackers",
    "WandbLogger": "mlx_train.training.trackers",
    "Trainer": "mlx_train.training.trainer",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "EMA",
    "Callback",
    "CrossEntropyLoss",
    "DataLoader",
    "DistributedTrainer",
    "EarlyStopping",
    "Heartbeat",
    "MLflowLogger",
    "MetricsLogger",
    "ModelCheckpoint",
    "ProgressBar",
    "Pruning",
    "ReduceLROnPlateau",
    "TensorBoardLogger",
    "Trainer",
    "WandbLogger",
]

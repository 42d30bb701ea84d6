"""Training: the Trainer, the DataLoader and the callbacks.

Example::

    from mlx_train.training import Trainer, DataLoader, ModelCheckpoint, EarlyStopping
"""

from typing import Any

from mlx_train.data import DataLoader
from mlx_train.training.callbacks import Callback, EarlyStopping, ModelCheckpoint, ReduceLROnPlateau
from mlx_train.training.ema import EMA
from mlx_train.training.heartbeat import Heartbeat
from mlx_train.training.loggers import MetricsLogger, ProgressBar
from mlx_train.training.losses import CrossEntropyLoss
from mlx_train.training.pruning import Pruning
from mlx_train.training.tensorboard import TensorBoardLogger
from mlx_train.training.trackers import MLflowLogger, WandbLogger
from mlx_train.training.trainer import Trainer


def __getattr__(name: str) -> Any:
    # DistributedTrainer belongs to the distributed runtime, a layer above the training loop.
    if name == "DistributedTrainer":
        import importlib

        return importlib.import_module("mlx_train.distributed.trainer").DistributedTrainer
    raise AttributeError(f"module 'mlx_train.training' has no attribute '{name}'")


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

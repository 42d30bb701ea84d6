"""mlx-train: a training framework for MLX.

Example::

    from mlx_train import Trainer
    trainer = Trainer(model=model, optimizer=optimizer, batch_size=32)
    history = trainer.train(train_dataset=(x, y), val_dataset=(vx, vy), epochs=10)
"""

from __future__ import annotations

# First: in the mlx-train command's process, Ctrl-C before the command can catch it is one line (see _start.py).
from mlx_train import _start

_start.guard()

from typing import TYPE_CHECKING  # noqa: E402

# The optimized BLAS must be loaded before anything imports mlx.core (Linux CPU; see _blas.py).
from mlx_train import _blas  # noqa: E402

_blas.preload()

from mlx_train._lazy import lazy_exports  # noqa: E402
from mlx_train.errors import (  # noqa: E402
    CheckpointError,
    ConfigError,
    DataError,
    DeviceError,
    DistributedError,
    MLXTrainError,
    NonFiniteError,
    OutOfMemoryError,
    TrainingInterrupted,
)

if TYPE_CHECKING:
    from mlx_train.config import TrainConfig
    from mlx_train.device import DeviceConfig
    from mlx_train.distributed import DistributedConfig
    from mlx_train.memory import MemoryOptimizer
    from mlx_train.run_directory import RunDirectory
    from mlx_train.training import (
        EMA,
        Callback,
        CrossEntropyLoss,
        DataLoader,
        DistributedTrainer,
        EarlyStopping,
        Heartbeat,
        MetricsLogger,
        MLflowLogger,
        ModelCheckpoint,
        ProgressBar,
        Pruning,
        ReduceLROnPlateau,
        TensorBoardLogger,
        Trainer,
        WandbLogger,
    )

__version__ = "0.1.0"

# Heavier pieces load on first use (PEP 562) so `import mlx_train` stays cheap: the CLI's help and
# the monitor import this package and must not load the training stack or MLX.
_TRAINING = ("Trainer", "DataLoader", "ModelCheckpoint", "EarlyStopping", "DistributedTrainer", "Callback",
             "CrossEntropyLoss", "EMA", "Heartbeat", "MetricsLogger", "ProgressBar", "Pruning",
             "ReduceLROnPlateau", "TensorBoardLogger", "MLflowLogger", "WandbLogger")
_LAZY = {
    "TrainConfig": "mlx_train.config",
    "DeviceConfig": "mlx_train.device",
    "DistributedConfig": "mlx_train.distributed",
    "MemoryOptimizer": "mlx_train.memory",
    "RunDirectory": "mlx_train.run_directory",
    **{name: "mlx_train.training" for name in _TRAINING},
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DeviceError",
    "DistributedError",
    "NonFiniteError",
    "TrainingInterrupted",
    "MLXTrainError",
    "OutOfMemoryError",
    "TrainConfig",
    "DeviceConfig",
    "DistributedConfig",
    "MemoryOptimizer",
    "RunDirectory",
    "Trainer",
    "DataLoader",
    "ModelCheckpoint",
    "EarlyStopping",
    "DistributedTrainer",
    "Callback",
    "CrossEntropyLoss",
    "EMA",
    "Heartbeat",
    "MetricsLogger",
    "ProgressBar",
    "Pruning",
    "ReduceLROnPlateau",
    "TensorBoardLogger",
    "MLflowLogger",
    "WandbLogger",
    "__version__",
]

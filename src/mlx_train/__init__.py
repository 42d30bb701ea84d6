"""mlx-train: a training framework for MLX.

Example::

    from mlx_train import Trainer
    trainer = Trainer(model=model, optimizer=optimizer, batch_size=32)
    history = trainer.train(train_dataset=(x, y), val_dataset=(vx, vy), epochs=10)
"""

from __future__ import annotations

from typing import Any

# The optimized BLAS must be loaded before anything imports mlx.core (Linux CPU; see _blas.py).
from mlx_train import _blas

_blas.preload()

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
    **{name: "mlx_train.training" for name in _TRAINING},
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mlx_train' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    *_TRAINING,
    "__version__",
]

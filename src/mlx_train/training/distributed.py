"""Data-parallel training over ``mlx.core.distributed``.

Example (run with ``mlx.launch -n 2 python train.py``)::

    trainer = DistributedTrainer(model=model, optimizer=optimizer, device_config=hw_config,
                                 strategy="data_parallel")
    trainer.train(train_dataset, val_dataset)
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from mlx_train.config import TrainConfig
from mlx_train.errors import ConfigError, did_you_mean
from mlx_train.training.trainer import Trainer

STRATEGIES = ("data_parallel",)


class DistributedTrainer(Trainer):
    """A Trainer whose processes each train on their slice of every global batch.

    Gradients are averaged across ranks inside the compiled step; metrics are summed across
    ranks at report time; only rank 0 prints and writes checkpoints and metrics. With one
    process it trains exactly like ``Trainer``. ``batch_size`` is per process: the global batch is
    ``world_size * batch_size * gradient_accumulation``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: optim.Optimizer | None = None,
        loss_fn: Callable | None = None,
        device_config: Any = None,
        strategy: str = "data_parallel",
        config: TrainConfig | None = None,
        **overrides: Any,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown distributed strategy '{strategy}'{did_you_mean(strategy, STRATEGIES)}; "
                f"available: {', '.join(STRATEGIES)}"
            )
        super().__init__(model, optimizer, loss_fn, device_config, config=config, **overrides)
        self.strategy = strategy
        self.group = mx.distributed.init()

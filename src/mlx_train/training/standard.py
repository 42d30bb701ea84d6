"""The callbacks a run gets from its configuration, before the topology's and the user's.

Example::

    callbacks = CallbackList(default_callbacks(config, is_main=True) + user_callbacks)
"""

from __future__ import annotations

from typing import Any

from mlx_train.training.callbacks import EarlyStopping
from mlx_train.training.ema import EMA
from mlx_train.training.heartbeat import Heartbeat
from mlx_train.training.loggers import MetricsLogger, ProgressBar
from mlx_train.training.pruning import Pruning


def default_callbacks(config: Any, is_main: bool) -> list[Any]:
    """The callbacks a run gets from its configuration: progress, metrics file, trackers (rank 0), the
    heartbeat (every rank), early stopping, and the step extensions (``prune_sparsity``, ``ema_decay``)."""
    cfg = config
    callbacks: list[Any] = [ProgressBar()] if is_main else []
    if cfg.run_dir and is_main:
        callbacks.append(MetricsLogger(cfg.run_dir))
    if cfg.report_to and is_main:
        from mlx_train.training.trackers import trackers_for

        callbacks += trackers_for(cfg)
    if cfg.run_dir:  # every rank: the monitor shows each one's progress and memory
        callbacks.append(Heartbeat(cfg.run_dir))
    if cfg.early_stopping_patience is not None:
        callbacks.append(EarlyStopping(monitor=cfg.monitor, patience=cfg.early_stopping_patience,
                                       min_delta=cfg.early_stopping_min_delta, mode=cfg.monitor_mode))
    pruning = None if cfg.prune_sparsity is None else Pruning(
        cfg.prune_sparsity, start_step=cfg.prune_start, end_step=cfg.prune_end, frequency=cfg.prune_frequency,
        schedule=cfg.prune_schedule, scope=cfg.prune_scope)  # the weights' masks: the EMA is masked like them
    ema = None if cfg.ema_decay is None else EMA(cfg.ema_decay, pruning=pruning)
    return callbacks + [c for c in (pruning, ema) if c is not None]

"""Small helpers the loop reads every step: cadences, where a loader is in its epoch, what a batch holds.

Example::

    every = Cadences(config)
    if every.save.by_step(step) and not at_epoch_end(loader): ...
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlx_train.config import Every, TrainConfig, parse_every
from mlx_train.data import DataLoader


class Cadence:
    """One cadence (``Every``) as two cheap checks for the loop."""

    def __init__(self, every: Every) -> None:
        self.step_n = every.n if every.unit == "step" else 0
        self.epoch_n = every.n if every.unit == "epoch" else 0

    def by_step(self, step: int) -> bool:
        return bool(self.step_n) and step % self.step_n == 0

    def by_epoch(self, epochs_done: int) -> bool:
        return bool(self.epoch_n) and epochs_done % self.epoch_n == 0


class Cadences:
    """The loop's three cadences: report, validate, save."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.report = Cadence(parse_every(cfg.report_every))
        self.validate = Cadence(parse_every(cfg.eval_every))
        self.save = Cadence(parse_every(cfg.checkpoint_every))


def length_of(loader: Any) -> int | None:
    """Batches per epoch, or None for a stream."""
    try:
        return len(loader)
    except TypeError:
        return None


def at_epoch_end(loader: Any) -> bool:
    """The loader has handed out its epoch's last batch (known-length DataLoaders only)."""
    if not isinstance(loader, DataLoader):
        return False
    length = length_of(loader)
    return length is not None and loader.position >= length


def total_steps(loader: Any, epochs: int, max_steps: int | None) -> int | None:
    per_epoch = length_of(loader)
    candidates = [x for x in (max_steps, per_epoch * epochs if per_epoch else None) if x]
    return min(candidates) if candidates else None


def batch_place(loader: Any) -> str:
    """", batch 4 of 10" for a DataLoader (the batch just trained), else ""."""
    length = length_of(loader) if isinstance(loader, DataLoader) else None
    if length is None:
        return ""
    return f", batch {loader.position} of {length}"


def nonfinite_inputs(batch: Any) -> str:
    """Which samples of a batch hold NaN/Inf values (only computed on the error path)."""
    arrays = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]
    bad: set[int] = set()
    for array in arrays:
        values = np.asarray(array)
        if values.dtype.kind == "f" and values.ndim >= 1:
            rows = ~np.isfinite(values.reshape(values.shape[0], -1)).all(axis=1)
            bad.update(int(i) for i in np.nonzero(rows)[0])
    if not bad:
        return ""
    listed = ", ".join(str(i) for i in sorted(bad)[:5])
    return f"; the batch's samples at positions {listed}{' ...' if len(bad) > 5 else ''} hold NaN/Inf values"

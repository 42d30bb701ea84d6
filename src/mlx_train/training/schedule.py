"""Small helpers the loop reads every step: cadences, where a loader is in its epoch, what a batch holds.

Example::

    every = Cadences(config)
    if every.save.by_step(step) and not at_epoch_end(loader): ...
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, cast

import numpy as np

from mlx_train.config import Every, TrainConfig, parse_every
from mlx_train.data import DataLoader
from mlx_train.training.state import summed_over_ranks


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


def epochs_for(loader: Any, config: TrainConfig) -> int:
    """``epochs: null``: as many passes as ``max_steps`` needs (a loader of unknown length: until max_steps)."""
    per_epoch = length_of(loader)
    return math.ceil((config.max_steps or 1) / per_epoch) if per_epoch else 2**62


@lru_cache(maxsize=8)
def summed_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    """The running sums that are summed over ranks (and reported), of a step's running keys (the same every
    report: found once)."""
    return tuple(k for k in keys if summed_over_ranks(k))


def step_periods(every: Cadences) -> tuple[int, ...]:
    """The step cadences' periods (report, validation, save counted in steps), found once per run."""
    return tuple(c.step_n for c in (every.report, every.validate, every.save) if c.step_n)


def next_due(periods: tuple[int, ...], step: int) -> float:
    """The next step after ``step`` at which a report, validation or save is due (``periods``: the step
    cadences, ``step_periods``)."""
    if len(periods) == 1:
        return (step // periods[0] + 1) * periods[0]
    return min((step // n + 1) * n for n in periods) if periods else math.inf


def micro_loader(loader: Any, config: TrainConfig) -> Any:
    """A user's DataLoader yields micro-batches: one step takes ``gradient_accumulation`` of them (any other
    iterable gives one optimizer step per item, as it is)."""
    accumulation = config.gradient_accumulation
    if not isinstance(loader, DataLoader) or accumulation == 1:
        return loader
    return loader.replace(batch_size=loader.batch_size * accumulation)


def train_loader(dataset: Any, config: TrainConfig) -> DataLoader:
    """The training loader of ``dataset`` (a DataLoader's batch is a micro-batch, as in ``fit``)."""
    if isinstance(dataset, DataLoader):
        return cast(DataLoader, micro_loader(dataset, config))
    return DataLoader(dataset, batch_size=config.batch_size * config.gradient_accumulation, shuffle=config.shuffle,
                      num_workers=config.num_workers, drop_last=config.drop_last, seed=config.seed)


def eval_loader(dataset: Any, config: TrainConfig) -> Any:
    """The evaluation loader of ``dataset`` (a DataLoader as it is)."""
    if isinstance(dataset, DataLoader):
        return dataset
    return DataLoader(dataset, batch_size=config.eval_batch_size or config.batch_size, shuffle=False,
                      num_workers=config.num_workers, drop_last=False, seed=config.seed)

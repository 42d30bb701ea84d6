"""The logs of an epoch: the training loss and metrics from the running sums (summed over ranks), the last
validation, the learning rate.

Example::

    logs = epoch_logs(totals, state.last_val, learning_rate=1e-3)   # {"train_loss": ..., "val_loss": ...}
    history = with_open_epoch(state, read_totals, learning_rate=1e-3)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_train.training.losses import metric_means

_NOT_LOGGED = ("step", "epoch", "val_time")  # a validation's own fields, not the epoch's


def train_logs(totals: dict[str, float]) -> dict[str, float]:
    """``train_loss`` (and the loss's declared metrics) of the running sums ``totals``."""
    logs = {"train_loss": totals["loss_sum"] / max(totals["items"], 1.0)}
    logs.update(metric_means(totals, totals["items"], "train_"))
    return logs


def epoch_logs(logs: dict[str, Any], last_val: dict[str, Any], learning_rate: float) -> dict[str, Any]:
    """``logs`` with the last validation's values and the learning rate added."""
    logs.update({k: v for k, v in last_val.items() if k not in _NOT_LOGGED})
    logs["learning_rate"] = learning_rate
    return logs


def with_open_epoch(state: Any, totals: Callable[[], dict[str, float]], learning_rate: float) -> dict[str, list[Any]]:
    """The history, plus the epoch the run stopped in when it stopped before that epoch's end (a run
    counted in steps): its train_loss so far and the last validation. Checkpoints keep only whole epochs.
    ``totals()`` reads the running sums (summed over ranks)."""
    if state.epoch_done or not state.running:
        return state.history  # type: ignore[no-any-return]
    sums = totals()
    if not sums["items"]:
        return state.history  # type: ignore[no-any-return]
    logs = epoch_logs({"epoch": state.epoch, **train_logs(sums)}, state.last_val, learning_rate)
    extended = {k: list(v) for k, v in state.history.items()}
    for key, value in logs.items():
        extended.setdefault(key, []).append(value)
    return extended

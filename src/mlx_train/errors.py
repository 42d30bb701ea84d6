"""The errors mlx-train raises.

Every error says what happened, where, and how to fix it. The CLI turns any
``MLXTrainError`` into one message and a non-zero exit code (``--debug`` shows
the traceback).

Example::

    from mlx_train.errors import OutOfMemoryError, DeviceError

    try:
        trainer.train(train_dataset, val_dataset)
    except OutOfMemoryError:
        print("Reduce batch size or enable gradient accumulation")
    except DeviceError as e:
        print(f"Device error occurred: {e}")
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MLXTrainError(Exception):
    """Base class of every error mlx-train raises on purpose."""

    exit_code = 1


class ConfigError(MLXTrainError, ValueError):
    """A configuration value, key or file is wrong."""

    exit_code = 2


class DataError(MLXTrainError, ValueError):
    """A dataset or batch has the wrong shape, type or content."""

    exit_code = 3


class CheckpointError(MLXTrainError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""

    exit_code = 4


class DeviceError(MLXTrainError, RuntimeError):
    """The requested device is not available or failed."""

    exit_code = 5


class OutOfMemoryError(MLXTrainError, MemoryError):
    """An allocation failed, or a step went over the configured memory budget."""

    exit_code = 6


class DistributedError(MLXTrainError, RuntimeError):
    """A distributed group failed: a rank is missing, slow, or out of sync."""

    exit_code = 7


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest candidate, or ``""``."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


class NonFiniteError(MLXTrainError, FloatingPointError):
    """A loss or gradient became NaN or infinite (with ``nonfinite="raise"``, the default)."""

    exit_code = 8


class TrainingInterrupted(SystemExit):
    """Training stopped on SIGTERM or SIGINT after saving a checkpoint.

    A ``SystemExit`` whose code is ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), so an
    uncaught one ends the process the way schedulers expect; ``checkpoint`` is the path saved
    (None without a ``checkpoint_dir``); ``received`` is False on a rank of a group that stopped because
    another rank got the signal (the ranks' stop vote).
    """

    def __init__(self, signum: int, step: int, checkpoint: str | None, message: str, received: bool = True) -> None:
        super().__init__(128 + signum)
        self.signum, self.step, self.checkpoint, self.message = signum, step, checkpoint, message
        self.received = received

    def __str__(self) -> str:
        return self.message

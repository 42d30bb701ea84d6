"""Resuming a run: which checkpoint to restore (falling back to older ones), restoring this rank's part of it,
and the interruption report.

Example::

    found = restore_latest(RunDirectory("runs/a", "runs/a/checkpoints"), "auto", restore, log)
    if found is not None:
        path, restored = found
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from mlx_train.checkpointing.manager import CheckpointManager, CheckpointWarning
from mlx_train.config import TrainConfig
from mlx_train.errors import CheckpointError, ConfigError, TrainingInterrupted
from mlx_train.run_directory import RunDirectory
from mlx_train.training.resume import keep_global_batch

T = TypeVar("T")


def restore_latest(run: RunDirectory, resume: str | None, restore: Callable[[str], T],
                   log: Callable[[str], None]) -> tuple[str, T] | None:
    """Restore the checkpoint ``resume`` names (``restore(path)``); None when there is none to restore.

    With ``resume="auto"`` a checkpoint that passes its checks but cannot be restored (damaged
    after its manifest was written) is skipped for the previous one, with a warning.
    """
    candidates = run.resume_candidates(resume, log)
    for i, path in enumerate(candidates):
        try:
            return path, restore(path)
        except ConfigError:
            raise  # the run's settings do not fit the checkpoint: an older one would not fit either
        except (CheckpointError, KeyError, ValueError, RuntimeError) as error:
            if resume != "auto" or i == len(candidates) - 1:
                if isinstance(error, CheckpointError):
                    raise
                raise CheckpointError(f"checkpoint {path} cannot be restored ({type(error).__name__}: {error}); "
                                      "resume from an earlier checkpoint, or start without resume") from error
            warnings.warn(f"checkpoint {path} cannot be restored ({type(error).__name__}: {error}); trying the "
                          f"previous one, {candidates[i + 1]}", CheckpointWarning, stacklevel=4)
    return None


def restore_checkpoint(path: str, loader: Any, callbacks: Any, state: Any, model: Any, optimizer: Any,
                       config: TrainConfig, topology: Any, log: Callable[[str], None]) -> tuple[Any, TrainConfig]:
    """Restore checkpoint ``path`` into the loop state, model, optimizer, loader and callbacks (this rank's
    part, as the topology says); returns the loader and config, resized when the checkpoint was written by
    another number of processes (same global batch)."""
    from mlx_train.checkpointing import load_checkpoint

    with topology.restoring(path):
        arrays, saved = load_checkpoint(path)
        arrays = topology.restored_arrays(path, arrays, saved)
        resized, config = keep_global_batch(path, saved, loader, config, topology.batch_ranks, log)
        state.restore(path, arrays, saved, model, optimizer, resized, callbacks, rank=topology.rank)
    return resized, config


def interruption(signum: int, step: int, checkpoints: CheckpointManager | None, is_main: bool,
                 log: Callable[[str], None], received: bool = True) -> TrainingInterrupted:
    """The error a run stopped by ``signum`` at ``step`` ends with (logged): where it was saved, how to resume.
    ``received``: the signal reached this process (False on a rank that stopped with its group)."""
    name = signal.Signals(signum).name
    saved: Any = None
    if checkpoints is None:
        where = "no checkpoint_dir was set, so nothing was saved"
    elif not is_main:
        where = "rank 0 saved the checkpoint"
    else:
        saved = checkpoints.resolve("auto")
        where = f"saved {saved}; resume with train(..., resume='auto') or --resume"
    message = f"training stopped by {name} at step {step}: {where}"
    log(message)
    return TrainingInterrupted(signum, step, saved, message, received)

"""Which checkpoint a run resumes from, and the locks that keep one run per directory.

Example::

    with run_locks(checkpoints, "runs/a", main=True):
        for path in resume_candidates(checkpoints, "auto", print):
            ...                                    # the newest first, then older ones to fall back on
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from mlx_train.checkpointing.lock import RunLock
from mlx_train.checkpointing.manager import CheckpointManager
from mlx_train.errors import CheckpointError, ConfigError


def resume_candidates(checkpoints: CheckpointManager | None, resume: str | None,
                      log: Callable[[str], None]) -> list[str]:
    """Checkpoints to try, newest first: one for an explicit path; for "auto" every complete one.

    "auto" with no checkpoint yet starts from scratch; with checkpoints that are all damaged it
    refuses (starting over silently would hide the damage).
    """
    if not resume:
        return []
    if resume != "auto":
        # A path resolves to a checked path (or raises), never None.
        return [checkpoints.resolve(resume) if checkpoints is not None else resume]  # type: ignore[list-item]
    if checkpoints is None:
        raise ConfigError("resume='auto' needs a checkpoint_dir to look in; pass checkpoint_dir=... or a "
                          "checkpoint path")
    newest = checkpoints.resolve("auto")
    if newest is None:
        if checkpoints.has_step_directories():
            raise CheckpointError(
                f"every checkpoint in {checkpoints.directory} is incomplete or damaged (see the warnings above), "
                "so there is nothing to resume from. To start fresh, use a new checkpoint_dir or remove those "
                "checkpoints; nothing was deleted")
        log(f"no checkpoint in {checkpoints.directory} yet; starting from scratch")
        return []
    older = [info.path for info in reversed(checkpoints.checkpoints()) if info.path != newest]
    return [newest] + older


@contextlib.contextmanager
def run_locks(checkpoints: CheckpointManager | None, run_dir: str | None, main: bool) -> Iterator[None]:
    """One run per checkpoint and run directory (the main process holds the locks); proves them writable."""
    locks = []
    if main:
        if checkpoints is not None:
            locks.append(RunLock(checkpoints.directory, "checkpoint_dir"))
        if run_dir and (checkpoints is None or os.path.abspath(run_dir) != os.path.abspath(checkpoints.directory)):
            locks.append(RunLock(run_dir, "run_dir"))
    try:
        for lock in locks:
            lock.acquire()
        yield
    finally:
        for lock in locks:
            lock.release()

"""Which checkpoint a run resumes from, the locks that keep one run per directory, and what a new run
does in a directory that holds a run (refused; with ``overwrite`` the old run is moved aside first).

Example::

    with run_locks(checkpoints, "runs/a", main=True):
        for path in resume_candidates(checkpoints, "auto", print):
            ...                                    # the newest first, then older ones to fall back on
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from mlx_train import rundir
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


def _previous_runs(checkpoints: CheckpointManager | None, run_dir: str | None) -> list[tuple[str, list[str]]]:
    """``[(directory, what of a run it holds)]``: the run directory, and a checkpoint directory outside it."""
    inside = checkpoints is not None and run_dir is not None and \
        os.path.abspath(checkpoints.directory).startswith(os.path.abspath(run_dir) + os.sep)
    found = []
    if run_dir:
        contents = rundir.run_contents(run_dir, inside and checkpoints.has_step_directories())  # type: ignore[union-attr]
        found.append((run_dir, contents))
    if checkpoints is not None and not inside and checkpoints.has_step_directories():
        found.append((checkpoints.directory, ["checkpoints"]))
    return [(where, contents) for where, contents in found if contents]


def refuse_fresh_start(checkpoints: CheckpointManager | None, run_dir: str | None) -> None:
    """Raise ConfigError when a new run (no resume) would write into a directory that holds another run's
    checkpoints, metrics or config: it would overwrite them and mix two runs. Called under the run locks."""
    for where, contents in _previous_runs(checkpoints, run_dir):
        raise rundir.fresh_start_refused(where, contents)


def make_room(checkpoints: CheckpointManager | None, run_dir: str | None, overwrite: bool,
              log: Callable[[str], None]) -> None:
    """Clear the way for a new run: a directory that holds a run is refused (ConfigError), or with
    ``overwrite`` (``--overwrite``) renamed to ``<dir>.old-<date>-<time>``, never deleted. A directory a
    live run holds is refused first (CheckpointError, the lock's message); nothing is changed then.

    Example: ``make_room(CheckpointManager("runs/a/checkpoints"), "runs/a", overwrite=True, log=print)``
    """
    for where, contents in _previous_runs(checkpoints, run_dir):
        if "://" in where:
            raise ConfigError(f"{where} holds a run and is not a local directory, so it cannot be moved aside; "
                              "choose a new checkpoint_dir, or resume the run")
        with RunLock(where, "run_dir" if where == run_dir else "checkpoint_dir"):
            pass  # taken and given back at once: raises while another run holds the directory
        if not overwrite:
            raise rundir.fresh_start_refused(where, contents)
        moved = rundir.move_aside(where)
        log(f"moved the previous run in {where} aside to {moved}")

"""The run-directory policy in one object: where a run's checkpoints go, the locks that keep one run per
directory, what a new run does in a directory that holds a run, and which checkpoint a resume continues.

``train``, ``finetune``, the launcher and the Python API (``Trainer.train``) all go through ``RunDirectory``:

- checkpoints go to ``checkpoint_dir`` when one is given, else ``RUN_DIR/checkpoints`` for the applications
  (``RunDirectory.of``); the Python API saves checkpoints only where ``checkpoint_dir`` says;
- a new run (no resume) into a directory that holds a run is refused, or with ``overwrite`` the old run is
  moved aside to ``<dir>.old-<date>-<time>`` (never deleted); a directory a live run holds is refused first;
- ``resume="auto"`` continues from the newest complete checkpoint, falling back on older ones;
- ``checkpoints`` is the run's ``CheckpointManager``: read-only, or the one the Trainer saves with.

The file names and the run-directory layout are ``mlx_train.rundir``'s.

Example::

    run = RunDirectory.of("runs/a")                       # checkpoints in runs/a/checkpoints
    run.make_room(overwrite=False, log=print)             # ConfigError when runs/a holds a run
    with run.locks(main=True):
        for path in run.resume_candidates("auto", print):
            ...                                           # the newest first, then older ones to fall back on
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mlx_train import rundir
from mlx_train.checkpointing.lock import RunLock
from mlx_train.checkpointing.manager import CheckpointManager
from mlx_train.errors import CheckpointError, ConfigError


class RunDirectory:
    """A run directory (``path``, may be None for a Trainer given only ``checkpoint_dir``) and the
    directory of its checkpoints (``checkpoint_dir``, None: the run saves none).

    Example::

        run = RunDirectory("runs/a", "runs/a/checkpoints")
        run.resolve("auto")     # "runs/a/checkpoints/step-00000400", or None before the first checkpoint
    """

    def __init__(self, path: str | os.PathLike[str] | None, checkpoint_dir: str | os.PathLike[str] | None = None,
                 checkpoints: CheckpointManager | None = None) -> None:
        self.path = str(path) if path else None
        self.checkpoint_dir = checkpoints.directory if checkpoints is not None else \
            str(checkpoint_dir) if checkpoint_dir else None
        self._manager = checkpoints

    @classmethod
    def of(cls, run_dir: str | os.PathLike[str] | None,
           checkpoint_dir: str | os.PathLike[str] | None = None) -> RunDirectory:
        """The run of the applications (``train``, ``finetune``, the launcher): checkpoints in ``checkpoint_dir``,
        else ``RUN_DIR/checkpoints``.

        Example: ``RunDirectory.of("runs/a").checkpoint_dir == "runs/a/checkpoints"``
        """
        return cls(run_dir, rundir.checkpoints_path(run_dir, checkpoint_dir))

    @classmethod
    def choose(cls, config: Any, resume: str | None, runs_root: str = "runs") -> RunDirectory:
        """The run a ``train`` command writes: ``config.run_dir``, else the run of ``resume``, else a new
        timestamped directory under ``runs_root`` (``rundir.choose_run_dir``); checkpoints as ``of`` says.

        Example: ``RunDirectory.choose(TrainConfig(model="mlp", dataset="digits"), None).path`` is
        ``"runs/mlp-digits-20250101-120000"``.
        """
        return cls.of(rundir.choose_run_dir(config, resume, runs_root), config.checkpoint_dir)

    def configure(self, config: Any) -> Any:
        """``config`` (a TrainConfig) with this run's ``run_dir`` and ``checkpoint_dir``."""
        return config.replace(run_dir=self.path, checkpoint_dir=self.checkpoint_dir)

    def __repr__(self) -> str:
        return f"RunDirectory({self.path!r}, {self.checkpoint_dir!r})"

    # ------------------------------------------------------------------------------ checkpoints
    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The run's checkpoints, to list and resolve: the manager that saves them when one was given (the
        Trainer's), else a read-only one; None without a checkpoint directory."""
        if self._manager is None and self.checkpoint_dir:
            self._manager = CheckpointManager(self.checkpoint_dir, keep_last=None, async_save=False)
        return self._manager

    def resolve(self, resume: str | None) -> str | None:
        """The checked checkpoint ``resume`` names ("auto": the newest complete one, None before the first).

        A checkpoint path given without a checkpoint directory is resolved in its own parent directory.
        """
        if self.checkpoints is not None:
            return self.checkpoints.resolve(resume)
        if resume == "auto":
            raise ConfigError("resume 'auto' looks in RUN_DIR/checkpoints: pass a run directory (--run-dir) or a "
                              "checkpoint_dir, or a checkpoint path")
        if not resume:
            return None
        directory = os.path.dirname(str(resume)) or "."
        return CheckpointManager(directory, keep_last=None, async_save=False).resolve(resume)

    def resume_candidates(self, resume: str | None, log: Callable[[str], None]) -> list[str]:
        """Checkpoints to try, newest first: one for an explicit path; for "auto" every complete one.

        "auto" with no checkpoint yet starts from scratch; with checkpoints that are all damaged it
        refuses (starting over silently would hide the damage).
        """
        checkpoints = self.checkpoints
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

    def has_checkpoint_or_config(self) -> bool:
        """True when the run saved something to continue from: a checkpoint directory or its config.yaml."""
        saved = self.path is not None and (Path(self.path) / rundir.CONFIG_FILE).is_file()
        local = self.checkpoint_dir is not None and "://" not in self.checkpoint_dir
        return saved or (local and any(Path(str(self.checkpoint_dir)).glob("step-*")))

    # ------------------------------------------------------------------------------ one run per directory
    def _locks(self) -> list[RunLock]:
        """The locks of this run: its checkpoint directory's, and its run directory's when that is another."""
        locks = []
        if self.checkpoint_dir is not None:
            locks.append(RunLock(self.checkpoint_dir, "checkpoint_dir"))
        if self.path and (self.checkpoint_dir is None or
                          os.path.abspath(self.path) != os.path.abspath(self.checkpoint_dir)):
            locks.append(RunLock(self.path, "run_dir"))
        return locks

    @contextlib.contextmanager
    def locks(self, main: bool) -> Iterator[None]:
        """One run per checkpoint and run directory (the main process holds the locks); proves them writable."""
        locks = self._locks() if main else []
        try:
            for lock in locks:
                lock.acquire()
            yield
        finally:
            for lock in locks:
                lock.release()

    def refuse_if_held(self) -> None:
        """Raise CheckpointError (naming the holder's pid and host) while a live process holds this run's locks,
        before anything is launched on it; nothing is changed (a lock taken here is given back at once).

        Example: ``RunDirectory.of("runs/a").refuse_if_held()`` raises while a run trains in runs/a.
        """
        for lock in self._locks():
            if "://" not in lock.directory and os.path.isdir(lock.directory):
                with lock:
                    pass

    def previous_runs(self) -> list[tuple[str, list[str]]]:
        """``[(directory, what of a run it holds)]``: the run directory, and a checkpoint directory outside it."""
        checkpoints, run_dir = self.checkpoints, self.path
        inside = checkpoints is not None and run_dir is not None and \
            os.path.abspath(checkpoints.directory).startswith(os.path.abspath(run_dir) + os.sep)
        found = []
        if run_dir:
            held = inside and checkpoints.has_step_directories()  # type: ignore[union-attr]
            found.append((run_dir, rundir.run_contents(run_dir, held)))
        if checkpoints is not None and not inside and checkpoints.has_step_directories():
            found.append((checkpoints.directory, ["checkpoints"]))
        return [(where, contents) for where, contents in found if contents]

    def refuse_fresh_start(self) -> None:
        """Raise ConfigError when a new run (no resume) would write into a directory that holds another run's
        checkpoints, metrics or config: it would overwrite them and mix two runs. Called under the run locks."""
        for where, contents in self.previous_runs():
            raise rundir.fresh_start_refused(where, contents)

    def make_room(self, overwrite: bool, log: Callable[[str], None]) -> None:
        """Clear the way for a new run: a directory that holds a run is refused (ConfigError), or with
        ``overwrite`` (``--overwrite``) renamed to ``<dir>.old-<date>-<time>``, never deleted. A directory a
        live run holds is refused first (CheckpointError, the lock's message); nothing is changed then.

        Example: ``RunDirectory.of("runs/a").make_room(overwrite=True, log=print)``
        """
        for where, contents in self.previous_runs():
            if "://" in where:
                raise ConfigError(f"{where} holds a run and is not a local directory, so it cannot be moved aside; "
                                  "choose a new checkpoint_dir, or resume the run")
            with RunLock(where, "run_dir" if where == self.path else "checkpoint_dir"):
                pass  # taken and given back at once: raises while another run holds the directory
            if not overwrite:
                raise rundir.fresh_start_refused(where, contents)
            moved = rundir.move_aside(where)
            log(f"moved the previous run in {where} aside to {moved}")

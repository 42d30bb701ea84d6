"""One process per run: a lock file in the checkpoint and run directories.

``RunLock(directory)`` creates ``directory/.mlx-train.lock`` (host, pid, start time) with an
exclusive create. A second process on the same directory is refused with a message naming the
holder; the lock of a process that is gone (same host, pid not running) is taken over with a
warning. Creating the file also proves the directory is writable, before any training. Remote
(fsspec URL) directories are not locked: object stores have no exclusive create; acquiring
checks instead that their bucket exists, before any training. Failing to release only warns.

Example::

    with RunLock("runs/a"):
        trainer.train(...)
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from typing import Any

from mlx_train import processes
from mlx_train.checkpointing.manager import storage_error_hint
from mlx_train.checkpointing.storage import BucketMissing, check_location
from mlx_train.errors import CheckpointError

LOCK_FILE = ".mlx-train.lock"


def _alive(pid: int, process_started: float | None) -> bool:
    """The holder still runs: not ended, not a zombie left unreaped, not another process with its pid."""
    return processes.alive(pid, process_started)


class RunLock:
    """An exclusive lock on a local directory for the lifetime of a run (see the module docstring)."""

    def __init__(self, directory: str, what: str = "checkpoint_dir") -> None:
        self.directory, self.what = directory, what
        self.path = os.path.join(directory, LOCK_FILE)
        self.held = False

    def acquire(self) -> RunLock:
        if "://" in self.directory:
            self._check_remote()
            return self
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as error:
            raise CheckpointError(f"{self.what} {self.directory} cannot be created ({error.strerror or error}); "
                                  "choose a directory you can write to") from error
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"{self.what} {self.directory} is a file, not a directory; choose another path")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
              "process_started": processes.start_time(os.getpid())}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as error:
                raise CheckpointError(
                    f"{self.what} {self.directory} is not writable ({error.strerror or error}); fix its permissions "
                    "or choose another directory — nothing was trained yet") from error
            with os.fdopen(fd, "w") as file:
                json.dump(me, file)
            self.held = True
            return self
        raise CheckpointError(f"could not take the lock {self.path}: another process keeps creating it")

    def _check_remote(self) -> None:
        # No lock on an object store, but its bucket must exist before any training, not at the first save.
        try:
            check_location(self.directory)
        except CheckpointError:
            raise  # already says what to install
        except Exception as error:
            hint = storage_error_hint(error) or "check the URL and the network"
            if isinstance(error, BucketMissing):
                hint = "mlx-train never creates buckets: create it first, or fix the bucket name in the URL"
            raise CheckpointError(f"{self.what} {self.directory} cannot be used ({type(error).__name__}: {error}); "
                                  f"{hint} — nothing was trained yet") from error

    def _take_over_if_stale(self) -> None:
        holder = self._holder()
        host, pid = holder.get("host"), holder.get("pid")
        started = holder.get("process_started")
        process_started = float(started) if isinstance(started, (int, float)) else None
        if host == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() \
                and not _alive(pid, process_started):
            warnings.warn(f"{self.what} {self.directory} was locked by pid {pid} on {host}, which is no longer "
                          "running; taking the lock over", stacklevel=4)
            self._remove()
            return
        if host == socket.gethostname() and pid == os.getpid():
            raise CheckpointError(
                f"{self.what} {self.directory} is already used by another training run in this process; wait for it "
                "to finish, or give this run its own directory")
        started = holder.get("started")
        since = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float))
                 else "?")
        raise CheckpointError(
            f"{self.what} {self.directory} is in use by another run: pid {pid} on host {host} (since {since}). "
            "Two runs on one directory overwrite each other's checkpoints. Use another directory, or stop that run; "
            f"if it is gone (e.g. its machine died), delete {self.path}")

    def _holder(self) -> dict[str, Any]:
        try:
            with open(self.path) as file:
                value = json.load(file)
            return value if isinstance(value, dict) else {}
        except (OSError, ValueError):
            return {}  # being written right now, or damaged: treated as held by an unknown process

    def _remove(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def release(self) -> None:
        """Remove the lock file; failing to (the directory became unwritable or was replaced) only warns.

        The run has ended by then: its own outcome (a finished run, or a save error) is what counts.
        """
        held, self.held = self.held, False
        try:
            if held and self._holder().get("pid") == os.getpid():
                self._remove()
        except OSError as error:
            warnings.warn(f"could not remove the lock {self.path} ({error.strerror or error}); a later run "
                          "takes it over, since this process will have ended", stacklevel=2)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

"""What each rank of a distributed run does besides training: its heartbeat and a collective watchdog.

Each rank keeps its heartbeat (``<run_dir>/heartbeat-<r>.json``, the one schema of
``mlx_train.rundir.HeartbeatRecord``) fresh from a background thread every ``interval``
seconds: pid, host, completed steps, whether it is waiting in a collective, and its state
(``running``, ``failed`` with the error, ``finished``...). The Trainer's ``Heartbeat`` callback
adds the progress figures to the same file. The supervisor reads these files to notice a rank
that stopped responding; a rank whose collective waits longer than ``timeout`` reads its peers'
files to name the missing rank. The same thread watches the supervisor
(``mlx_train.distributed.orphan``): a rank whose supervisor is gone stops as on SIGTERM.

A blocked collective cannot be interrupted from Python (MLX waits in C++ with the GIL
released), so the watchdog thread ends the process: it records and prints the
``DistributedError`` and exits with code 7. The launcher then stops the other ranks.

The environment the supervisor sets for its ranks is read in ``mlx_train.distributed.environment``
(re-exported here).

Example::

    monitor = RankMonitor(group.rank(), group.size(), directory="runs/a", timeout=60.0)
    with monitor.collective("gradient all-reduce"):
        mx.eval(mx.distributed.all_sum(x))
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from mlx_train import rundir
from mlx_train.distributed import registry
from mlx_train.distributed.environment import ENV_ATTEMPT as ENV_ATTEMPT
from mlx_train.distributed.environment import ENV_BACKEND as ENV_BACKEND
from mlx_train.distributed.environment import ENV_RESUME as ENV_RESUME
from mlx_train.distributed.environment import ENV_RUN_DIR as ENV_RUN_DIR
from mlx_train.distributed.environment import ENV_RUN_ID as ENV_RUN_ID
from mlx_train.distributed.environment import ENV_STATE_DIR as ENV_STATE_DIR
from mlx_train.distributed.environment import in_group as in_group
from mlx_train.distributed.environment import is_main_process as is_main_process
from mlx_train.distributed.environment import launched_rank as launched_rank
from mlx_train.distributed.environment import restart_resume as restart_resume
from mlx_train.distributed.environment import supervised as supervised
from mlx_train.distributed.orphan import SupervisorWatch
from mlx_train.errors import DistributedError, TrainingInterrupted
from mlx_train.rundir import HeartbeatRecord

if TYPE_CHECKING:
    from mlx_train.training.trainer import Trainer

STALE_AFTER = 3.0  # seconds without a heartbeat after which a peer counts as not responding (at most)


def describe_peer(rank: int, info: HeartbeatRecord | None, now: float, my_step: int,
                  stale_after: float = STALE_AFTER) -> str | None:
    """Why peer ``rank`` is holding up a collective, or None when it looks fine.

    Example: ``"rank 1 is not responding (no heartbeat for 4.2 s; pid 812 on mac2, 6 steps done)"``
    """
    if info is None:
        return f"rank {rank} has never reported (no heartbeat file): it may not have started"
    where = f"pid {info.pid} on {info.host}, last heartbeat after step {info.step}"
    if info.state == "failed":
        return f"rank {rank} failed: {info.error or 'unknown error'} ({where})"
    if not info.live:
        return f"rank {rank} has exited ({info.state}; {where})"
    if rundir.is_stale(info, now, stale_after):
        return f"rank {rank} is not responding (no heartbeat for {now - info.time:.1f} s; {where})"
    if info.step < my_step:
        doing = f"waiting in the {info.waiting['what']}" if info.waiting else \
            "not in a collective (data loading, a callback?)"
        return f"rank {rank} is alive but behind: {info.step} steps done against {my_step} here, {doing} ({where})"
    return None


def missing_ranks(directory: str | os.PathLike[str] | None, me: int, world_size: int, my_step: int,
                  stale_after: float = STALE_AFTER) -> list[str]:
    """Descriptions of the peers that are holding up this rank (empty when none can be named)."""
    peers = rundir.read_heartbeats(rundir.run_dir_of(directory)) if directory is not None else {}
    now = time.time()
    found = []
    for rank in range(world_size):
        if rank != me:
            why = describe_peer(rank, peers.get(rank), now, my_step, stale_after)
            if why:
                found.append(why)
    return found


class RankMonitor:
    """Heartbeat and collective watchdog of one rank (a callback the DistributedTrainer adds).

    ``directory`` is the run directory (or its ``distributed/`` folder) whose
    ``heartbeat-<rank>.json`` this rank keeps fresh (None: no file; the watchdog still runs but
    cannot name the missing rank). ``on_timeout(error)`` defaults to printing the error and
    ending the process with exit code 7.
    """

    def __init__(self, rank: int, world_size: int, directory: str | os.PathLike[str] | None, timeout: float,
                 interval: float = 0.5, on_timeout: Callable[[DistributedError], None] | None = None) -> None:
        self.rank, self.world_size, self.timeout, self.interval = rank, world_size, float(timeout), interval
        self.directory = rundir.run_dir_of(directory) if directory is not None else None
        self.on_timeout = on_timeout or _exit_with
        self.step = 0
        self.state = "running"
        self.error: BaseException | None = None
        self._waiting: tuple[str, float, float] | None = None  # (what, monotonic start, wall start)
        self._fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.zero_rank_metrics: Callable[[], None] | None = None
        # A peer silent for this long is frozen; well below the timeout, so that it shows by then.
        self.stale_after = min(STALE_AFTER, max(2 * interval, self.timeout / 2))
        self._writer = rundir.HeartbeatWriter.of(self.directory, rank) if self.directory is not None else None
        self._supervisor = SupervisorWatch.from_environment()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> RankMonitor:
        """Write the first heartbeat and start the background thread (idempotent)."""
        if self._thread is not None:
            return self
        self.write()
        if self.world_size > 1 or supervised():

            registry.register("rank", rank=self.rank, world_size=self.world_size, run_id=os.environ.get(ENV_RUN_ID),
                              run_dir=str(self.directory) if self.directory else None)
        self._thread = threading.Thread(target=self._loop, name=f"mlx-train-rank{self.rank}-monitor", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        return self

    def close(self) -> None:
        """Stop the thread; a rank that leaves while still running is recorded ``interrupted``."""
        self._stop.set()
        if self._writer is not None and self._writer.record.live:
            self.state = "interrupted"
        self.write()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()
            if self._supervisor is not None:
                self._supervisor.check(self.rank)
            waiting = self._waiting
            if waiting is not None and not self._fired and time.monotonic() - waiting[1] > self.timeout:
                self._fired = True
                self._fire(waiting[0], time.monotonic() - waiting[1])

    # ------------------------------------------------------------------ the watchdog
    def arm(self, what: str) -> None:
        """This rank starts waiting in a collective described by ``what``."""
        self._waiting = (what, time.monotonic(), time.time())

    def disarm(self) -> None:
        self._waiting = None

    @contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Guard a blocking collective (evaluate its result inside the block)."""
        self.arm(what)
        try:
            yield
        finally:
            self.disarm()

    def timeout_error(self, what: str, waited: float) -> DistributedError:
        """The ``DistributedError`` for a collective that waited ``waited`` seconds."""
        missing = missing_ranks(self.directory, self.rank, self.world_size, self.step, self.stale_after)
        if missing:
            who = "; ".join(missing)
        elif self.directory is None:
            who = ("which rank is missing is unknown: ranks write heartbeat files only under the supervisor "
                   "(mlx-train train --distributed) or with run_dir set")
        else:
            who = f"every peer still reports progress in {self.directory}, so the missing rank cannot be named"
        return DistributedError(
            f"rank {self.rank} waited {waited:.1f} s (collective_timeout {self.timeout:g} s) in the {what} of "
            f"step {self.step + 1}: {who}. Check that process and its host's network; a supervised run "
            "(mlx-train train --distributed --max-restarts N) restarts from the last checkpoint; raise "
            "collective_timeout if steps legitimately take longer"
        )

    def lost_peer_error(self, error: BaseException) -> DistributedError:
        """A ``DistributedError`` for the backend's "connection lost" error, naming the peer if possible."""
        time.sleep(min(1.0, self.interval * 2))  # let a failing peer's last heartbeat land
        missing = missing_ranks(self.directory, self.rank, self.world_size, self.step, self.stale_after)
        who = "; ".join(missing) if missing else "the peer that left could not be named (no heartbeat files)"
        return DistributedError(
            f"rank {self.rank} lost its connection to the group during step {self.step + 1} ({error}): {who}. "
            "A supervised run (mlx-train train --distributed) restarts the group from the last checkpoint"
        )

    def _fire(self, what: str, waited: float) -> None:
        error = self.timeout_error(what, waited)
        self.record_failure(error)
        self.on_timeout(error)

    # ------------------------------------------------------------------ the heartbeat
    def record_failure(self, error: BaseException) -> None:
        """Mark this rank ``failed`` with ``error`` (written immediately)."""
        self.state, self.error = "failed", error
        self.write()

    def write(self) -> None:
        """Refresh this rank's heartbeat with its step, state and collective (at most the state moves forward)."""
        if self._writer is None:
            return
        waiting = self._waiting
        fields: dict[str, Any] = {
            "world_size": self.world_size, "run_id": os.environ.get(ENV_RUN_ID), "steady": True,
            "attempt": int(os.environ.get(ENV_ATTEMPT, "0") or 0), "interval": self.interval,
            "waiting": None if waiting is None else {"what": waiting[0], "since": waiting[2]},
        }
        with self._lock:
            record = self._writer.record
            fields["step"] = max(record.step, self.step)
            if self.state != "running":
                fields["state"] = self.state  # failed, interrupted, finished
            elif record.state == "starting":
                fields["state"] = "running"  # else the callback's finer state (validating...) stands
            if self.error is not None:
                kind = type(self.error).__name__
                fields["error_type"], fields["error"] = kind, f"{kind}: {self.error}"
            self._writer.update(**fields)

    # ------------------------------------------------------------------ callback events
    def on_fit_start(self, trainer: Trainer) -> None:
        self.step, self.state, self.error = trainer.step, "running", None
        if self._writer is not None:
            self._writer.update(state="running", write=False)
        self.start()

    def on_batch_end(self, trainer: Trainer, step: int) -> None:
        self.step = step
        self._waiting = None

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        self._waiting = None
        if isinstance(error, (KeyboardInterrupt, TrainingInterrupted)):  # stopped on request, not failed
            self.state = "interrupted"
            if isinstance(error, TrainingInterrupted) and error.received:  # the signal came here, not by the vote
                self.error = error
            if self._supervisor is not None:  # a SIGTERM may come before the thread's look: say why
                self._supervisor.check(self.rank, stop=False)
            self.write()
            return
        self.record_failure(error)

    def on_fit_end(self, trainer: Trainer, history: dict[str, Any]) -> None:
        self.state = "finished"
        self.write()

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Restored running metrics are global sums (see Topology.share_running): rank 0 keeps them.
        if self.rank != 0 and self.zero_rank_metrics is not None:
            self.zero_rank_metrics()


def _exit_with(error: DistributedError) -> None:
    """Print the error the way the CLI does and end the process (a blocked collective cannot be left)."""
    try:
        print(f"mlx-train: error: DistributedError: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(DistributedError.exit_code)


class _Tee:
    """A text stream that also appends everything to a log file. The console may go (the pipe of a
    supervisor that was killed): the rank goes on, and stops as its watch says, with the log complete."""

    def __init__(self, stream: TextIO, log: TextIO) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        self._log.write(text)
        self._log.flush()
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        self._log.flush()
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def tee_output(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Copy this process's stdout and stderr to ``<run_dir>/logs/rank-<rank>.log`` (appending)."""
    path = rundir.rank_log_path(run_dir, rank)
    if isinstance(sys.stdout, _Tee):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a", encoding="utf-8", buffering=1)
    log.write(f"--- rank {rank}, pid {os.getpid()}, attempt {os.environ.get(ENV_ATTEMPT, '0')}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    return path

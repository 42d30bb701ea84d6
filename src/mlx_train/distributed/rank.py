"""What each rank of a distributed run does besides training: a heartbeat file and a collective watchdog.

Each rank keeps ``<state dir>/rank-<r>.json`` up to date from a background thread (every
``interval`` seconds): pid, host, completed steps, whether it is waiting in a collective, and its
status (``running``, ``failed`` with the error, ``exited``). The supervisor reads these files to
notice a rank that stopped responding; a rank whose collective waits longer than ``timeout``
reads its peers' files to name the missing rank.

A blocked collective cannot be interrupted from Python (MLX waits in C++ with the GIL
released), so the watchdog thread ends the process: it records and prints the
``DistributedError`` and exits with code 7. The launcher then stops the other ranks.

Environment set by the supervisor for its ranks: ``MLX_TRAIN_RUN_ID``, ``MLX_TRAIN_STATE_DIR``
(the heartbeat files), ``MLX_TRAIN_RUN_DIR`` (per-rank logs go to ``logs/rank-<r>.log``),
``MLX_TRAIN_ATTEMPT`` (0, 1, ... one per restart) and, on restarts, ``MLX_TRAIN_RESUME=auto``.

Example::

    monitor = RankMonitor(group, directory="runs/a/distributed", timeout=60.0)
    with monitor.collective("gradient all-reduce"):
        mx.eval(mx.distributed.all_sum(x))
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from mlx_train.errors import DistributedError
from mlx_train.training.callbacks import Callback

ENV_RUN_ID = "MLX_TRAIN_RUN_ID"
ENV_STATE_DIR = "MLX_TRAIN_STATE_DIR"
ENV_RUN_DIR = "MLX_TRAIN_RUN_DIR"
ENV_ATTEMPT = "MLX_TRAIN_ATTEMPT"
ENV_RESUME = "MLX_TRAIN_RESUME"
ENV_BACKEND = "MLX_TRAIN_BACKEND"

STALE_AFTER = 3.0  # seconds without a heartbeat after which a peer counts as not responding (at most)


def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    """``<directory>/rank-<rank>.json``"""
    return Path(directory) / f"rank-{rank}.json"


def read_rank_files(directory: str | os.PathLike | None) -> dict[int, dict]:
    """Every readable ``rank-<r>.json`` in ``directory`` by rank (a file being replaced is skipped)."""
    found: dict[int, dict] = {}
    if directory is None or not Path(directory).is_dir():
        return found
    for path in Path(directory).glob("rank-*.json"):
        try:
            data = json.loads(path.read_text())
            found[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """Write JSON under a temporary name, then rename (readers never see half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def supervised() -> bool:
    """True inside a rank started by the mlx-train supervisor."""
    return bool(os.environ.get(ENV_STATE_DIR))


def restart_resume() -> str | None:
    """``"auto"`` when the supervisor restarted this group (resume from the last checkpoint)."""
    return os.environ.get(ENV_RESUME) or None


def describe_peer(rank: int, info: dict | None, now: float, my_step: int, stale_after: float = STALE_AFTER) -> str | None:
    """Why peer ``rank`` is holding up a collective, or None when it looks fine.

    Example: ``"rank 1 is not responding (no heartbeat for 4.2 s; pid 812 on mac2, 6 steps done)"``
    """
    if info is None:
        return f"rank {rank} has never reported (no heartbeat file): it may not have started"
    where = f"pid {info.get('pid')} on {info.get('host')}, last heartbeat after step {info.get('step', 0)}"
    status = info.get("status")
    if status == "failed":
        return f"rank {rank} failed: {info.get('error_type', 'error')}: {info.get('error')} ({where})"
    if status == "exited":
        return f"rank {rank} has exited ({where})"
    silent = now - float(info.get("heartbeat_at", 0.0))
    if silent > stale_after:
        return f"rank {rank} is not responding (no heartbeat for {silent:.1f} s; {where})"
    if int(info.get("step", 0)) < my_step:
        waiting = info.get("waiting")
        doing = f"waiting in the {waiting['what']}" if waiting else "not in a collective (data loading, a callback?)"
        return f"rank {rank} is alive but behind: {info.get('step', 0)} steps done against {my_step} here, {doing} ({where})"
    return None


def missing_ranks(directory: str | os.PathLike | None, me: int, world_size: int, my_step: int,
                  stale_after: float = STALE_AFTER) -> list[str]:
    """Descriptions of the peers that are holding up this rank (empty when none can be named)."""
    peers = read_rank_files(directory)
    now = time.time()
    found = []
    for rank in range(world_size):
        if rank != me:
            why = describe_peer(rank, peers.get(rank), now, my_step, stale_after)
            if why:
                found.append(why)
    return found


class RankMonitor(Callback):
    """Heartbeat file and collective watchdog of one rank (a callback the DistributedTrainer adds).

    ``directory`` holds the heartbeat files (None: no files; the watchdog still runs but cannot
    name the missing rank). ``on_timeout(error)`` defaults to printing the error and ending the
    process with exit code 7.
    """

    def __init__(self, rank: int, world_size: int, directory: str | os.PathLike | None, timeout: float,
                 interval: float = 0.5, on_timeout: Callable[[DistributedError], None] | None = None) -> None:
        self.rank, self.world_size, self.timeout, self.interval = rank, world_size, float(timeout), interval
        self.directory = Path(directory) if directory is not None else None
        self.on_timeout = on_timeout or _exit_with
        self.step = 0
        self.status = "running"
        self.error: BaseException | None = None
        self._waiting: tuple[str, float, float] | None = None  # (what, monotonic start, wall start)
        self._fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._started_at = time.time()
        self.zero_rank_metrics: Callable[[], None] | None = None
        # A peer silent for this long is frozen; well below the timeout, so that it shows by then.
        self.stale_after = min(STALE_AFTER, max(2 * interval, self.timeout / 2))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "RankMonitor":
        """Write the first heartbeat and start the background thread (idempotent)."""
        if self._thread is not None:
            return self
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.write()
        if self.world_size > 1 or supervised():
            from mlx_train.distributed import registry

            registry.register("rank", rank=self.rank, world_size=self.world_size, run_id=os.environ.get(ENV_RUN_ID),
                              state_dir=str(self.directory) if self.directory else None)
        self._thread = threading.Thread(target=self._loop, name=f"mlx-train-rank{self.rank}-monitor", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        return self

    def close(self) -> None:
        """Stop the thread and mark the rank ``exited`` (or leave it ``failed``)."""
        self._stop.set()
        if self.status == "running":
            self.status = "exited"
        self.write()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()
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

    # ------------------------------------------------------------------ status
    def record_failure(self, error: BaseException) -> None:
        """Mark this rank ``failed`` with ``error`` (written immediately)."""
        self.status, self.error = "failed", error
        self.write()

    def snapshot(self) -> dict[str, Any]:
        waiting = self._waiting
        data = {
            "rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "host": socket.gethostname(),
            "run_id": os.environ.get(ENV_RUN_ID), "attempt": int(os.environ.get(ENV_ATTEMPT, "0") or 0),
            "status": self.status, "step": self.step, "heartbeat_at": time.time(), "started_at": self._started_at,
            "waiting": None if waiting is None else {"what": waiting[0], "since": waiting[2]},
        }
        if self.error is not None:
            data["error_type"], data["error"] = type(self.error).__name__, str(self.error)
        return data

    def write(self) -> None:
        if self.directory is None:
            return
        with self._lock:
            try:
                write_json_atomic(rank_file(self.directory, self.rank), self.snapshot())
            except OSError:
                pass  # a full disk must not kill training; the supervisor sees a stale heartbeat

    # ------------------------------------------------------------------ callback events
    def on_fit_start(self, trainer) -> None:
        self.step = trainer.step
        self.start()

    def on_batch_end(self, trainer, step: int) -> None:
        self.step = step
        self._waiting = None

    def on_exception(self, trainer, error: BaseException) -> None:
        self._waiting = None
        self.record_failure(error)

    def state_dict(self) -> dict:
        return {"world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        # Restored running metrics are global sums (see DistributedTrainer._save): rank 0 keeps them.
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
    """A text stream that also appends everything to a log file."""

    def __init__(self, stream: TextIO, log: TextIO) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        self._log.write(text)
        self._log.flush()
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()
        self._log.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def tee_output(run_dir: str | os.PathLike, rank: int) -> Path:
    """Copy this process's stdout and stderr to ``<run_dir>/logs/rank-<rank>.log`` (appending)."""
    path = Path(run_dir) / "logs" / f"rank-{rank}.log"
    if isinstance(sys.stdout, _Tee):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a", encoding="utf-8", buffering=1)
    log.write(f"--- rank {rank}, pid {os.getpid()}, attempt {os.environ.get(ENV_ATTEMPT, '0')}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    return path

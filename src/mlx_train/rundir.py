"""The run directory protocol: the one place that names a run's files and says how they are written.

A run directory (``runs/<model>-<dataset>-<date>-<time>`` from the CLI, or a Trainer's ``run_dir``)::

    config.yaml             the TrainConfig the run uses
    metrics.jsonl           one JSON row per report, validation and epoch (rank 0); metrics.csv beside it
    train.log               the run's messages (the ``mlx_train`` logger)
    heartbeat-<rank>.json   one per process, schema ``HeartbeatRecord``, rewritten atomically
    checkpoints/            the CheckpointManager's step-<N> directories
    logs/rank-<rank>.log    each rank's stdout and stderr (distributed runs)
    distributed/            the supervisor's files: launch-config.yaml, hostfile.json,
                            restarts.jsonl, supervisor.log
    tensorboard/            TensorBoardLogger's event files

Writers and readers (the Trainer's callbacks, the rank monitor, the supervisor, ``mlx-train
monitor``/``status``) all use the names, the heartbeat schema, the staleness rule
(``stale_limit``/``is_stale``) and the atomic writer (``atomic_write``) defined here.

Example::

    from mlx_train import rundir
    rundir.atomic_write_json(rundir.heartbeat_path("runs/a", 0), record.to_json())
    beats = rundir.read_heartbeats("runs/a")                 # {0: HeartbeatRecord(...)}
    rundir.is_stale(beats[0], now=time.time(), minimum=60)   # True when rank 0 stopped beating
    rundir.log_message("runs/a", "resumed from step 200")    # console + runs/a/train.log
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeGuard

from mlx_train.errors import ConfigError

# ---------------------------------------------------------------------------------- file names
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
LOG_FILE = "train.log"
HEARTBEAT_PREFIX = "heartbeat-"
HEARTBEAT_GLOB = "heartbeat-*.json"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
TENSORBOARD_DIR = "tensorboard"
DISTRIBUTED_DIR = "distributed"
LAUNCH_CONFIG_FILE = "launch-config.yaml"
HOSTFILE_FILE = "hostfile.json"
RESTARTS_FILE = "restarts.jsonl"
SUPERVISOR_LOG = "supervisor.log"
RUN_MARKERS = (METRICS_FILE, CONFIG_FILE)
OLD_RUN_SUFFIX = ".old-"  # a run moved aside by --overwrite: <run_dir>.old-<date>-<time>


def heartbeat_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """``heartbeat_path("runs/a", 1) == Path("runs/a/heartbeat-1.json")``"""
    return Path(run_dir) / f"{HEARTBEAT_PREFIX}{rank}.json"


def rank_log_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """``runs/a/logs/rank-<rank>.log``: a rank's stdout and stderr."""
    return Path(run_dir) / LOGS_DIR / f"rank-{rank}.log"


def distributed_dir(run_dir: str | os.PathLike[str]) -> Path:
    """``runs/a/distributed``: the supervisor's files."""
    return Path(run_dir) / DISTRIBUTED_DIR


def run_dir_of(directory: str | os.PathLike[str]) -> Path:
    """The run directory of ``directory``, which is the run directory or its ``distributed/`` folder."""
    path = Path(directory)
    return path.parent if path.name == DISTRIBUTED_DIR else path


def looks_like_run(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory with a metrics file, a config or a heartbeat."""
    p = Path(path)
    return p.is_dir() and (any((p / m).exists() for m in RUN_MARKERS) or any(p.glob(HEARTBEAT_GLOB)))


def choose_run_dir(config: Any, resume: str | None, runs_root: str = "runs") -> Path:
    """Where a run writes: ``config.run_dir``, else the run of ``resume``, else a new timestamped directory.

    Example: ``choose_run_dir(TrainConfig(model="mlp", dataset="digits"), None)`` is
    ``runs/mlp-digits-20250101-120000``.
    """
    if config.run_dir:
        return Path(config.run_dir)
    if resume and resume != "auto" and Path(resume).parent.name == CHECKPOINTS_DIR:
        return Path(resume).parent.parent
    prefix = f"{config.model}-{config.dataset}-"
    if resume == "auto":
        previous = sorted(p for p in Path(runs_root).glob(prefix + "*") if (p / CHECKPOINTS_DIR).is_dir())
        if previous:
            return previous[-1]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir, count = Path(runs_root) / (prefix + stamp), 1
    while run_dir.exists():  # two runs started within the same second
        count += 1
        run_dir = Path(runs_root) / f"{prefix}{stamp}-{count}"
    return run_dir


def checkpoints_path(run_dir: str | os.PathLike[str] | None,
                     checkpoint_dir: str | os.PathLike[str] | None = None) -> str | None:
    """Where a run's checkpoints go: ``checkpoint_dir`` when given, else ``RUN_DIR/checkpoints`` (the one place
    that derives it), else None (no run directory: no checkpoints).

    Example: ``checkpoints_path("runs/a") == "runs/a/checkpoints"``
    """
    if checkpoint_dir:
        return str(checkpoint_dir)
    return str(Path(run_dir) / CHECKPOINTS_DIR) if run_dir else None


def run_contents(run_dir: str | os.PathLike[str] | None, has_checkpoints: bool = False) -> list[str]:
    """What of a run ``run_dir`` already holds: its ``metrics.jsonl``/``config.yaml``, plus ``"checkpoints"``
    when ``has_checkpoints`` (the caller looked in the checkpoint directory). Empty: a place for a new run.

    Example: ``run_contents("runs/a", has_checkpoints=True) == ["metrics.jsonl", "config.yaml", "checkpoints"]``
    """
    found = [name for name in RUN_MARKERS if run_dir and (Path(run_dir) / name).is_file()]
    return found + (["checkpoints"] if has_checkpoints else [])


def fresh_start_refused(where: str | os.PathLike[str], contents: list[str]) -> ConfigError:
    """The error of a new run pointed at a directory that holds a run (nothing was changed)."""
    return ConfigError(
        f"{where} already holds a run ({', '.join(contents)}); a new run there would overwrite it. To continue "
        f"it: --resume (Python: resume='auto'); to start over: --overwrite (Python: overwrite=True), which moves "
        f"it aside to {where}{OLD_RUN_SUFFIX}<date>-<time>; or choose another directory. Nothing was changed")



def move_aside(directory: str | os.PathLike[str]) -> Path:
    """Rename ``directory`` to ``<directory>.old-<date>-<time>`` (a free name) and return the new path.

    The old run stays whole beside the place of the new one: nothing is deleted or mixed.

    Example: ``move_aside("runs/a")`` -> ``Path("runs/a.old-20250101-120000")``
    """
    path = Path(directory)
    _detach_run_log(path)  # this process's later messages must not go to the moved run's train.log
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, count = path.with_name(f"{path.name}{OLD_RUN_SUFFIX}{stamp}"), 1
    while target.exists():
        count += 1
        target = path.with_name(f"{path.name}{OLD_RUN_SUFFIX}{stamp}-{count}")
    try:
        os.rename(path, target)
    except OSError as error:
        raise ConfigError(f"cannot move {path} aside to {target}: {error.strerror or error}; move or remove it "
                          "yourself, or choose another directory") from None
    return target


def write_config(run_dir: str | os.PathLike[str], config: Any) -> Path:
    """Write ``config`` (a TrainConfig) to ``<run_dir>/config.yaml`` atomically: a reader, or a resume after
    a kill, sees the old file or the new one, never an empty or half-written one.

    Example: ``write_config("runs/a", trainer.config)``
    """
    path = Path(run_dir) / CONFIG_FILE
    remove_leftovers(path)  # the run lock is held: no other writer of this file is mid-write
    try:
        atomic_write(path, config.yaml_text())
    except OSError as error:
        raise ConfigError(f"cannot write {path}: {error.strerror or error}; make room for that file (or fix the "
                          "permissions of its directory), or choose another run directory") from None
    return path


# ---------------------------------------------------------------------------------- atomic writes
def atomic_write(path: str | os.PathLike[str], data: bytes | str, durable: bool = True) -> None:
    """Replace the local file ``path`` with ``data`` so that a reader sees the old or the new file, never half.

    Written to a temporary file in the same directory, flushed to disk (``fsync``), then renamed
    over ``path`` with ``os.replace``; a crash before the rename leaves the old file untouched.
    ``durable=False`` skips the ``fsync`` for files rewritten every few seconds (heartbeats):
    readers still never see half a file, only a power cut could lose the newest version.

    Example: ``atomic_write("runs/a/heartbeat-0.json", json.dumps(record))``
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(payload)
            file.flush()
            if durable:
                os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def remove_leftovers(path: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files an ``atomic_write`` of ``path`` killed before its rename left beside it
    (``.NAME.*.tmp``); only for a file whose one writer is the caller. Returns what was removed."""
    path = Path(path)
    removed = []
    for leftover in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            leftover.unlink()
            removed.append(leftover)
        except OSError:
            pass  # another attempt will remove it
    return removed


def atomic_write_json(path: str | os.PathLike[str], data: Any, durable: bool = True) -> None:
    """``atomic_write`` of ``data`` as JSON."""
    atomic_write(path, json.dumps(data), durable)


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """The JSON in ``path``, or None when it is missing or unreadable (a reader never fails on it)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class RunFileWarning(UserWarning):
    """A file of the run directory (metrics, train.log, a heartbeat) could not be written; training went on."""


_failed_dirs: set[Path] = set()  # run directories whose failed write was reported (once each)
_failed_lock = threading.Lock()


def write_failed(path: str | os.PathLike[str], error: OSError) -> None:
    """Warn that the run's file ``path`` could not be written, once per run directory: those files are
    copies for people and monitors (checkpoints are the run's record), so training goes on.

    Example: ``except OSError as error: write_failed("runs/a/metrics.jsonl", error)``
    """
    directory = Path(os.path.abspath(path)).parent
    with _failed_lock:
        if directory in _failed_dirs:
            return
        _failed_dirs.add(directory)
    warnings.warn(f"cannot write {path} ({type(error).__name__}: {error.strerror or error}); training goes on, "
                  f"but {directory}'s metrics, train.log and heartbeat are not updated while this lasts "
                  "(checkpoints are the run's record, and one that cannot be saved still stops the run): fix the "
                  f"permissions of {directory}, or make room on its disk. Reported once per run.",
                  RunFileWarning, stacklevel=2)


def reset_write_failed(run_dir: str | os.PathLike[str]) -> None:
    """Report the next failed write in ``run_dir`` again (a new run starts there)."""
    with _failed_lock:
        _failed_dirs.discard(Path(os.path.abspath(run_dir)))


def write_run_file(path: str | os.PathLike[str], text: str, append: bool = False) -> bool:
    """Replace (atomically, not fsync'ed) or append to a file of the run directory that people and monitors
    read; False, after ``write_failed``'s one warning, when the disk refused it.

    Example: ``write_run_file("runs/a/metrics.jsonl", json.dumps(row) + "\\n", append=True)``
    """
    try:
        if append:
            with open(path, "a", encoding="utf-8", newline="") as file:
                file.write(text)
        else:
            atomic_write(path, text, durable=False)
    except OSError as error:
        write_failed(path, error)
        return False
    return True


# ---------------------------------------------------------------------------------- heartbeats
STATES = ("starting", "running", "validating", "checkpointing", "finished", "failed", "interrupted")
LIVE_STATES = frozenset({"starting", "running", "validating", "checkpointing"})
FINAL_STATES = frozenset({"finished", "failed", "interrupted"})


@dataclass
class HeartbeatRecord:
    """One process of a run, as written to ``heartbeat-<rank>.json`` (the one heartbeat schema).

    ``time`` is when it was written (Unix seconds) and ``interval`` the longest gap its writer
    leaves between two writes; ``steady`` is True when a background thread writes it (so its
    age does not depend on how long a step or a validation takes). ``waiting`` is
    ``{"what": ..., "since": ...}`` while the rank waits in a collective; ``error`` is
``"<type>: <message>"`` and ``error_type`` the type's name. ``extra`` holds the
    progress figures (``loss``, ``samples_per_second``, ``steps_per_second``, memory, ``timing``...).

    Example::

        record = HeartbeatRecord(rank=0, state="running", step=12, time=time.time())
        HeartbeatRecord.from_json(record.to_json()) == record    # True
    """

    rank: int
    state: str = "starting"
    step: int = 0
    time: float = 0.0
    world_size: int = 1
    pid: int = 0
    host: str = ""
    started: float = 0.0
    interval: float = 2.0
    steady: bool = False
    epoch: int | None = None
    epochs: int | None = None
    total_steps: int | None = None
    run_id: str | None = None
    attempt: int = 0
    waiting: dict[str, Any] | None = None
    error: str | None = None
    error_type: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ConfigError(f"heartbeat state must be one of {', '.join(STATES)}, got {self.state!r}")

    @property
    def live(self) -> bool:
        """True in the states of a process that is still working (not finished, failed, interrupted)."""
        return self.state in LIVE_STATES

    def get(self, key: str, default: Any = None) -> Any:
        """A schema field or a progress figure by name (``record.get("loss")``)."""
        if key in _FIELDS:
            value = getattr(self, key)
            return default if value is None else value
        return self.extra.get(key, default)

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object written to disk (progress figures beside the schema fields)."""
        data = {f: getattr(self, f) for f in _FIELDS}
        return {**self.extra, **data}

    @classmethod
    def from_json(cls, data: Any) -> HeartbeatRecord:
        """Parse a heartbeat file's object; ConfigError when it is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("rank"), int):
            raise ConfigError(f"not a heartbeat (an object with an integer 'rank'): {str(data)[:100]}")
        known = {k: data[k] for k in _FIELDS if k in data}
        return cls(**known, extra={k: v for k, v in data.items() if k not in _FIELDS})


_FIELDS = tuple(f.name for f in dataclasses.fields(HeartbeatRecord) if f.name != "extra")


def read_heartbeats(run_dir: str | os.PathLike[str] | None) -> dict[int, HeartbeatRecord]:
    """Every readable heartbeat of ``run_dir`` by rank (a file being replaced or foreign is skipped)."""
    found: dict[int, HeartbeatRecord] = {}
    if run_dir is None or not Path(run_dir).is_dir():
        return found
    for path in Path(run_dir).glob(HEARTBEAT_GLOB):
        try:
            record = HeartbeatRecord.from_json(read_json(path))
        except ConfigError:
            continue
        found[record.rank] = record
    return found


def stale_limit(beat: HeartbeatRecord, minimum: float) -> float:
    """Seconds without a new heartbeat after which ``beat``'s process counts as hung (the one rule).

    At least ``minimum`` and three write intervals; for a heartbeat written between steps (not
    ``steady``) also five of its steps and twice its last validation, which delay the next write.
    """
    limit = max(float(minimum), 3 * float(beat.interval or 0.0))
    if not beat.steady:
        rate, val_time = beat.extra.get("steps_per_second"), beat.extra.get("val_time")
        if _is_number(rate) and rate > 0:
            limit = max(limit, 5.0 / rate)
        if _is_number(val_time):
            limit = max(limit, 2 * float(val_time))
    return limit


def is_stale(beat: HeartbeatRecord, now: float, minimum: float) -> bool:
    """True when a live process has not written its heartbeat for longer than ``stale_limit``.

    Example: ``is_stale(HeartbeatRecord(rank=0, state="running", time=100.0), now=200.0, minimum=60)``
    is True; a ``finished`` heartbeat is never stale.
    """
    return beat.live and now - float(beat.time) > stale_limit(beat, minimum)


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class HeartbeatWriter:
    """The heartbeat file of one process: the fields its writers set, merged and written atomically.

    The Trainer's ``Heartbeat`` callback (progress) and a distributed rank's monitor (liveness,
    collectives) update the same writer, so each process has exactly one heartbeat file. Get it
    with ``HeartbeatWriter.of(run_dir, rank)``.

    Example::

        writer = HeartbeatWriter.of("runs/a", 0)
        writer.update(state="running", step=10, loss=0.42)     # written at once
    """

    _writers: ClassVar[dict[Path, HeartbeatWriter]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, run_dir: str | os.PathLike[str], rank: int) -> None:
        import socket

        self.path = heartbeat_path(run_dir, rank)
        now = time.time()
        self.record = HeartbeatRecord(rank=rank, pid=os.getpid(), host=socket.gethostname(), started=now, time=now)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, run_dir: str | os.PathLike[str], rank: int) -> HeartbeatWriter:
        """The writer of ``heartbeat-<rank>.json`` in ``run_dir`` for this process (one per file)."""
        path = heartbeat_path(run_dir, rank).resolve()
        with cls._registry_lock:
            writer = cls._writers.get(path)
            if writer is None or writer.record.pid != os.getpid():
                writer = cls._writers[path] = cls(run_dir, rank)
            return writer

    def update(self, write: bool = True, **fields: Any) -> None:
        """Set schema fields and progress figures; write the file unless ``write`` is False."""
        with self._lock:
            for key, value in fields.items():
                if key in _FIELDS:
                    setattr(self.record, key, value)
                else:
                    self.record.extra[key] = value
            if fields.get("state") is not None and fields["state"] not in STATES:
                raise ConfigError(f"heartbeat state must be one of {', '.join(STATES)}, got {fields['state']!r}")
        if write:
            self.write()

    def write(self) -> bool:
        """Write the file now (stamped with the current time); False when the disk refused it."""
        with self._lock:
            self.record.time = time.time()
            data = self.record.to_json()
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(self.path, data, durable=False)  # rewritten every few seconds
            except OSError as error:
                write_failed(self.path, error)  # a full disk must not stop training; readers see it go stale
                return False
        return True


# ---------------------------------------------------------------------------------- logging
LOGGER_NAME = "mlx_train"
_log_state: dict[str, Any] = {"file": None, "path": None}
_log_lock = threading.Lock()


class _ConsoleHandler(logging.StreamHandler[Any]):
    """Writes to whatever ``sys.stdout`` is at the time (so redirections made later are honoured)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout  # not setStream(): it flushes the previous stream, which may be closed by now
        super().emit(record)


class _RunLogHandler(logging.FileHandler):
    """``train.log``: a write the disk refuses (an unwritable run directory) warns once and never stops a run."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)  # opening the file (delayed to the first message) is outside handleError
        except OSError as error:
            self._failed(error)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            self._failed(error)
        else:
            super().handleError(record)

    def _failed(self, error: OSError) -> None:
        write_failed(self.baseFilename, error)
        stream, self.stream = self.stream, None  # reopened at the next message; the refused text is dropped
        if stream is not None:
            try:
                stream.close()  # closes the file even when flushing the refused text fails
            except OSError:
                pass


def get_logger() -> logging.Logger:
    """The ``mlx_train`` logger, with a console handler (stdout, message only) on first use.

    It does not propagate to the root logger, so that an application's own logging setup does
    not print every message twice; add handlers to ``logging.getLogger("mlx_train")`` to route
    them elsewhere.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        console = _ConsoleHandler()
        console.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(console)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def attach_run_log(run_dir: str | os.PathLike[str]) -> Path:
    """Send the ``mlx_train`` logger's messages to ``<run_dir>/train.log`` too (replacing an earlier run's file)."""
    path = (Path(run_dir) / LOG_FILE).resolve()
    logger = get_logger()
    with _log_lock:
        if _log_state["path"] == path and _log_state["file"] in logger.handlers:
            return path
        if _log_state["file"] is not None:
            logger.removeHandler(_log_state["file"])
            _log_state["file"].close()
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = _RunLogHandler(path, encoding="utf-8", delay=True)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        handler.addFilter(_SameRun(str(path.parent)))
        logger.addHandler(handler)
        _log_state.update(file=handler, path=path)
    return path


def _detach_run_log(directory: Path) -> None:
    """Stop writing the run log when it lies in ``directory`` (which is about to be moved)."""
    with _log_lock:
        handler, path = _log_state["file"], _log_state["path"]
        if handler is not None and directory.resolve() in Path(path).parents:
            get_logger().removeHandler(handler)
            handler.close()
            _log_state.update(file=None, path=None)


class _SameRun(logging.Filter):
    """Keeps a run's messages out of another run's train.log (messages of no run pass)."""

    def __init__(self, run_dir: str) -> None:
        super().__init__()
        self.run_dir = run_dir

    def filter(self, record: logging.LogRecord) -> bool:
        owner = getattr(record, "run_dir", self.run_dir)
        return owner == self.run_dir


def log_message(run_dir: str | os.PathLike[str] | None, message: str) -> None:
    """Print a run's message and, with a ``run_dir``, append it to ``<run_dir>/train.log`` (via ``logging``).

    Example: ``log_message("runs/a", "resumed from runs/a/checkpoints/step-00000200")``
    """
    owner = str(attach_run_log(run_dir).parent) if run_dir else ""
    get_logger().info(message, extra={"run_dir": owner})

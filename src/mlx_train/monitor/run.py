"""Reading a run directory: the contract between a training run and what watches it.

The files and their formats are ``mlx_train.rundir``'s: ``config.yaml``, ``metrics.jsonl`` (one
JSON row per report, validation and epoch, written by rank 0), ``heartbeat-<rank>.json`` (one
per process), ``checkpoints/`` and ``train.log``. ``RunReader`` reads a run directory
repeatedly and cheaply (only the new lines of ``metrics.jsonl``) into a ``RunSnapshot``; a
rank's staleness is ``rundir.is_stale``, whether its process still exists ``mlx_train.processes``.

Example::

    reader = RunReader("runs/mlp-digits-20250101-120000")
    snap = reader.read()
    snap.step, snap.total_steps, snap.state          # 230, 450, "running"
    snap.latest["loss"], snap.val[-1]["val_loss"]
    [r.status for r in snap.ranks]                    # ["running"] or ["stale"], ...
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from mlx_train import processes, rundir
from mlx_train.config import TrainConfig, metric_direction
from mlx_train.errors import ConfigError
from mlx_train.rundir import CONFIG_FILE, HEARTBEAT_GLOB, LOG_FILE, METRICS_FILE, RUN_MARKERS, looks_like_run

DEFAULT_STALE_AFTER = 60.0
TIMING_PARTS = ("time_data", "time_compute", "time_comm", "time_checkpoint")
#: Per step, in the rows of a run that counts its collectives (tensor parallelism): calls, and bytes per rank.
COMM_COUNTS = ("comm_collectives", "comm_bytes")

#: A JSON object as read from a run directory: a metrics.jsonl row, a heartbeat, the flattened config.
Row = dict[str, Any]


@dataclass
class RankStatus:
    """One process of the run, from its heartbeat file.

    ``status`` is the heartbeat's state (``running``, ``finished``, ``failed``, ``interrupted``),
    or ``stale`` (a running rank whose heartbeat is older than ``stale_limit`` seconds) or
    ``gone`` (its process no longer exists on this host). ``flagged`` is True for those two.
    """

    rank: int
    heartbeat: Row
    age: float
    status: str
    stale_limit: float

    @property
    def flagged(self) -> bool:
        return self.status in ("stale", "gone")


@dataclass
class CheckpointSummary:
    """A complete checkpoint: its step, path, save time (Unix seconds) and saved metrics."""

    step: int
    path: str
    saved_at: float
    metrics: Row = field(default_factory=dict)


@dataclass
class RunSnapshot:
    """Everything known about a run at one moment (see the module docstring)."""

    run_dir: str
    config: Row
    train: list[Row]
    val: list[Row]
    epochs: list[Row]
    ranks: list[RankStatus]
    checkpoints: list[CheckpointSummary]
    log_lines: list[str]
    now: float

    @property
    def name(self) -> str:
        return Path(self.run_dir).name

    @property
    def latest(self) -> Row:
        """The newest training report row (``{}`` before the first report)."""
        return self.train[-1] if self.train else {}

    @property
    def main_heartbeat(self) -> Row:
        return self.ranks[0].heartbeat if self.ranks else {}

    @property
    def step(self) -> int:
        steps = [self.latest.get("step", 0)] + [r.heartbeat.get("step", 0) for r in self.ranks]
        return max(int(s or 0) for s in steps)

    @property
    def epoch(self) -> int:
        """Current epoch, counted from 0."""
        return int(self.main_heartbeat.get("epoch", self.latest.get("epoch", 0)) or 0)

    @property
    def epochs_total(self) -> int | None:
        return self.main_heartbeat.get("epochs") or self.config.get("epochs")

    @property
    def total_steps(self) -> int | None:
        return self.main_heartbeat.get("total_steps") or self.config.get("max_steps")

    @property
    def state(self) -> str:
        """``running``, ``stale`` (a rank's heartbeat is too old), ``stopped`` (a rank's process is gone
        without saying why), ``failed``, ``interrupted``, ``finished`` or ``unknown`` (no heartbeat)."""
        statuses = [r.status for r in self.ranks]
        for state in ("failed", "interrupted"):
            if state in statuses:
                return state
        if "stale" in statuses:
            return "stale"
        if "gone" in statuses:
            return "stopped"
        if any(s in rundir.LIVE_STATES for s in statuses):
            return "running"
        if statuses and all(s == "finished" for s in statuses):
            return "finished"
        return "unknown"

    @property
    def steps_per_second(self) -> float | None:
        """Recent progress rate in optimizer steps per second of wall time (validation included)."""
        rows = _since_last_restart(self.train)[-12:]
        if len(rows) >= 2 and rows[-1]["time"] > rows[0]["time"] and rows[-1]["step"] > rows[0]["step"]:
            recent: float = (rows[-1]["step"] - rows[0]["step"]) / (rows[-1]["time"] - rows[0]["time"])
            return recent
        rate = self.main_heartbeat.get("steps_per_second") or self.latest.get("steps_per_second")
        return float(rate) if rate else None

    @property
    def elapsed(self) -> float | None:
        """Seconds since this process of the run started (to its end when it has ended)."""
        beat = self.main_heartbeat
        if not beat.get("started"):
            return None
        end: float = self.now if self.state == "running" else beat.get("time", self.now)
        started: float = beat["started"]
        return max(end - started, 0.0)

    @property
    def eta(self) -> float | None:
        """Seconds left at the recent rate (None when unknown; 0 when finished)."""
        if self.state == "finished":
            return 0.0
        if self.state not in ("running", "unknown"):
            return None
        total, rate = self.total_steps, self.steps_per_second
        if not total or not rate:
            return None
        return max(total - self.step, 0) / rate

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over the rows that have it (train, then val/epoch rows)."""
        for rows in (self.train, self.val, self.epochs):
            points = [(r["step"], float(r[key])) for r in rows if _is_number(r.get(key))]
            if points:
                return [p[0] for p in points], [p[1] for p in points]
        return [], []

    def best(self, key: str = "val_loss") -> tuple[float, int] | None:
        """(best value, step) of a validation metric, best by ``metric_direction(key)``."""
        steps, values = self.series(key)
        if not values:
            return None
        with warnings.catch_warnings():  # a display: a metric it cannot place is shown as lower-is-better, quietly
            warnings.simplefilter("ignore")
            pick = max if metric_direction(key) == "max" else min
        value = pick(values)
        return value, steps[values.index(value)]

    def timing(self, last: int = 5) -> dict[str, float]:
        """The step-time breakdown averaged over the last ``last`` reports (seconds per step).

        Keys: ``step_time``, ``time_data``, ``time_compute``, ``time_comm``, ``time_checkpoint``
        and ``time_other`` (what the parts do not cover: callbacks, logging); and, where the run
        counted its collectives (tensor parallelism), ``comm_collectives`` and ``comm_bytes`` per step.
        """
        rows = [r for r in self.train if _is_number(r.get("step_time"))][-last:]
        if not rows:
            return {}
        out = {k: sum(float(r.get(k) or 0.0) for r in rows) / len(rows) for k in ("step_time",) + TIMING_PARTS}
        out["time_other"] = max(out["step_time"] - sum(out[k] for k in TIMING_PARTS), 0.0)
        counted = [r for r in rows if _is_number(r.get("comm_bytes"))]
        if counted:
            for key in COMM_COUNTS:
                out[key] = sum(float(r.get(key) or 0.0) for r in counted) / len(counted)
        return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _since_last_restart(rows: list[Row]) -> list[Row]:
    """The rows after the last time the step went backwards (a resume from an older checkpoint)."""
    start = 0
    for i in range(1, len(rows)):
        if rows[i].get("step", 0) <= rows[i - 1].get("step", 0):
            start = i
    return rows[start:]


def rank_status(heartbeat: Row, now: float, stale_after: float = DEFAULT_STALE_AFTER) -> RankStatus:
    """Judge one heartbeat: its age, and whether the rank is stale (``rundir.is_stale``) or gone.

    A live rank is stale when its heartbeat is older than ``rundir.stale_limit``: the largest of
    ``stale_after``, three heartbeat intervals, five of its steps and twice its last validation.
    """
    try:
        beat = rundir.HeartbeatRecord.from_json({"rank": 0, "state": "running", **heartbeat})
    except (ConfigError, TypeError):
        beat = rundir.HeartbeatRecord(rank=int(heartbeat.get("rank") or 0), time=float(heartbeat.get("time") or 0.0))
    age = max(now - float(beat.time), 0.0)
    limit = rundir.stale_limit(beat, stale_after)
    status = str(heartbeat.get("state", "running"))
    if beat.live:
        if beat.host == socket.gethostname() and beat.pid > 0 and not processes.alive(beat.pid):
            status = "gone"
        elif rundir.is_stale(beat, now, stale_after):
            status = "stale"
    return RankStatus(beat.rank, heartbeat, age, status, limit)


def _last_activity(path: Path) -> float:
    files = [path / m for m in RUN_MARKERS] + list(path.glob(HEARTBEAT_GLOB))
    return max((f.stat().st_mtime for f in files if f.exists()), default=0.0)


def find_runs(root: str | os.PathLike[str] = "runs") -> list[Path]:
    """Run directories directly under ``root`` (and ``root`` itself if it is one), newest activity last."""
    base = Path(root)
    if not base.is_dir():
        return []
    runs = [p for p in base.iterdir() if looks_like_run(p)]
    if looks_like_run(base):
        runs.append(base)
    return sorted(runs, key=_last_activity)


def latest_run(root: str | os.PathLike[str] = "runs") -> Path:
    """The run under ``root`` that was active last; ConfigError when there is none."""
    runs = find_runs(root)
    if not runs:
        raise ConfigError(
            f"no run directory under {os.path.abspath(root)} (a run directory holds metrics.jsonl, config.yaml "
            "or heartbeat-*.json): pass RUN_DIR, or start a run with 'mlx-train train'"
        )
    return runs[-1]


def resolve_run_dir(run_dir: str | os.PathLike[str] | None, root: str | os.PathLike[str] = "runs") -> Path:
    """``run_dir`` checked to be a run directory, or the latest run under ``root`` when None."""
    if run_dir is None:
        return latest_run(root)
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"run directory {path} does not exist: pass a directory written by 'mlx-train train' "
                          "(runs/<model>-<dataset>-<date>-<time>) or leave RUN_DIR out for the latest run")
    if not looks_like_run(path):
        inside = [p.name for p in find_runs(path)]
        hint = (f"; it contains the runs {', '.join(inside[-5:])}: pass one of them" if inside else
                "; a run directory holds metrics.jsonl, config.yaml or heartbeat-*.json")
        raise ConfigError(f"{path} is not a run directory{hint}")
    return path


class RunReader:
    """Reads a run directory again and again, parsing only what was appended to metrics.jsonl.

    ``stale_after`` is the shortest heartbeat age (seconds) at which a running rank is flagged.
    """

    def __init__(self, run_dir: str | os.PathLike[str], stale_after: float = DEFAULT_STALE_AFTER) -> None:
        self.run_dir = Path(run_dir)
        self.stale_after = stale_after
        self._rows: list[Row] = []
        self._offset = 0
        self._tail = b""  # the last complete line read, to notice a file rewritten in place
        self._config: Row = {}
        self._config_mtime = -1.0

    def read(self, now: float | None = None) -> RunSnapshot:
        """A fresh snapshot of the run directory."""
        now = time.time() if now is None else now
        rows = self._read_metrics()
        config = self._read_config()
        beats = [rank_status(b, now, self.stale_after) for b in self._read_heartbeats()]
        return RunSnapshot(
            run_dir=str(self.run_dir), config=config,
            train=[r for r in rows if r.get("kind") == "train"],
            val=[r for r in rows if r.get("kind") == "val"],
            epochs=[r for r in rows if r.get("kind") == "epoch"],
            ranks=sorted(beats, key=lambda r: r.rank),
            checkpoints=self._read_checkpoints(config), log_lines=self._read_log(), now=now,
        )

    def _read_metrics(self) -> list[Row]:
        path = self.run_dir / METRICS_FILE
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset or not self._unchanged(f):
                    self._rows, self._offset, self._tail = [], 0, b""  # rewritten (a resume trims it)
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            self._rows, self._offset, self._tail = [], 0, b""
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return self._rows  # nothing complete yet: a writer may be mid-line
        for line in data[:end].split(b"\n"):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and _is_number(row.get("step", 0)):
                self._rows.append(row)
        lines = data[:end + 1].rsplit(b"\n", 2)
        self._tail = (lines[-2] if len(lines) >= 2 else b"") + b"\n"
        self._offset += end + 1
        return self._rows

    def _unchanged(self, f: BinaryIO) -> bool:
        if not self._tail:
            return True
        f.seek(self._offset - len(self._tail))
        return f.read(len(self._tail)) == self._tail

    def _read_config(self) -> Row:
        path = self.run_dir / CONFIG_FILE
        try:
            mtime = path.stat().st_mtime
            if mtime != self._config_mtime:
                loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
                if isinstance(loaded, dict):  # config.yaml is written by sections: flatten it
                    try:
                        loaded = TrainConfig.from_saved(loaded, source=str(path)).to_dict()
                    except ConfigError:
                        pass  # keep what it says as it is: the monitor shows a run, it does not judge it
                self._config, self._config_mtime = loaded if isinstance(loaded, dict) else {}, mtime
        except (OSError, yaml.YAMLError):
            pass
        return self._config

    def _read_heartbeats(self) -> list[Row]:
        beats = []
        for path in self.run_dir.glob(HEARTBEAT_GLOB):
            try:
                beat = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(beat, dict):
                beats.append(beat)
        return beats

    def _read_checkpoints(self, config: Row) -> list[CheckpointSummary]:
        directory = str(rundir.checkpoints_path(self.run_dir, config.get("checkpoint_dir")))
        if directory.startswith("file://"):
            directory = directory[len("file://"):]
        if "://" in directory or not os.path.isdir(directory):
            return []  # remote storage is not listed here
        found = []
        for entry in os.scandir(directory):
            if not entry.name.startswith("step-") or ".tmp-" in entry.name:
                continue
            try:
                with open(os.path.join(entry.path, "manifest.json")) as f:
                    manifest = json.load(f)
                found.append(CheckpointSummary(int(manifest["step"]), entry.path, float(manifest.get("saved_at", 0.0)),
                                               dict(manifest.get("metrics") or {})))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written, torn or foreign: only complete checkpoints count
        return sorted(found, key=lambda c: (c.saved_at, c.step))

    def _read_log(self, lines: int = 5) -> list[str]:
        path = self.run_dir / LOG_FILE
        try:
            with open(path, "rb") as f:
                f.seek(max(os.fstat(f.fileno()).st_size - 4096, 0))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()][-lines:]

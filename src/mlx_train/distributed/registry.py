"""Which processes belong to mlx-train distributed runs on this machine.

Supervisors and ranks each write ``<home>/processes/<host>-<pid>.json`` while they live (removed
at a normal exit). An entry whose process is gone is stale; ``mlx-train reset-distributed``
removes those and stops leftover processes. A process is recognised by its pid *and* its start
time (``mlx_train.processes``, psutil), so a recycled pid is never mistaken for it.

Example::

    register("supervisor", run_id="20250101-120000-4242", run_dir="runs/a")
    [entry["pid"] for entry in entries() if entry["alive"]]
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from mlx_train import processes
from mlx_train.distributed.config import home
from mlx_train.rundir import atomic_write_json


def registry_dir() -> Path:
    return home() / "processes"


def entry_path(pid: int | None = None) -> Path:
    return registry_dir() / f"{socket.gethostname()}-{pid or os.getpid()}.json"


def register(kind: str, **info: Any) -> Path:
    """Record this process (``kind`` "supervisor" or "rank") until it exits; returns the entry's path."""
    pid = os.getpid()
    entry = {"pid": pid, "host": socket.gethostname(), "kind": kind, "start_time": processes.start_time(pid),
             "started_at": time.time(), "cmdline": " ".join(sys.argv), **info}
    path = entry_path(pid)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, entry)
    except OSError:
        return path  # the registry is a convenience for status/reset; training goes on without it
    atexit.register(unregister, path)
    return path


def update(path: Path, **info: Any) -> None:
    """Change fields of this process's entry."""
    try:
        entry = json.loads(path.read_text())
        entry.update(info)
        atomic_write_json(path, entry)
    except (OSError, ValueError):
        pass


def unregister(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def entries() -> list[dict[str, Any]]:
    """Every entry of this host, each with ``alive`` (the process still runs) and ``path``."""
    found: list[dict[str, Any]] = []
    host = socket.gethostname()
    directory = registry_dir()
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob(f"{host}-*.json")):
        try:
            entry = json.loads(path.read_text())
            pid = int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            entry, pid = {"pid": None, "kind": "unreadable"}, None
        entry["path"] = str(path)
        entry["alive"] = pid is not None and processes.alive(pid, entry.get("start_time"))
        found.append(entry)
    return found

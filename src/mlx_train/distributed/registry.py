"""Which processes belong to mlx-train distributed runs on this machine.

Supervisors and ranks each write ``<home>/processes/<host>-<pid>.json`` while they live (removed
at a normal exit). An entry whose process is gone is stale; ``mlx-train reset-distributed``
removes those and stops leftover processes. A process is recognised by its pid *and* its start
time, so a recycled pid is never mistaken for it.

Example::

    register("supervisor", run_id="20250101-120000-4242", run_dir="runs/a")
    [entry["pid"] for entry in entries() if entry["alive"]]
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from mlx_train.distributed.config import home


def registry_dir() -> Path:
    return home() / "processes"


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot; Linux), or None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """True when ``pid`` runs (and, if ``start_time`` is given, is the same process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if start_time is not None:
        now = process_start_time(pid)
        if now is not None and now != start_time:
            return False
    return _state(pid) != "Z"


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with (empty when it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def process_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def entry_path(pid: int | None = None) -> Path:
    return registry_dir() / f"{socket.gethostname()}-{pid or os.getpid()}.json"


def register(kind: str, **info: Any) -> Path:
    """Record this process (``kind`` "supervisor" or "rank") until it exits; returns the entry's path."""
    pid = os.getpid()
    entry = {"pid": pid, "host": socket.gethostname(), "kind": kind, "start_time": process_start_time(pid),
             "started_at": time.time(), "cmdline": " ".join(sys.argv), **info}
    path = entry_path(pid)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
    except OSError:
        return path  # the registry is a convenience for status/reset; training goes on without it
    atexit.register(unregister, path)
    return path


def update(path: Path, **info: Any) -> None:
    """Change fields of this process's entry."""
    try:
        entry = json.loads(path.read_text())
        entry.update(info)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass


def unregister(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def entries() -> list[dict]:
    """Every entry of this host, each with ``alive`` (the process still runs) and ``path``."""
    found = []
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
        entry["alive"] = pid is not None and process_alive(pid, entry.get("start_time"))
        found.append(entry)
    return found


def group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` (other than zombies) exists."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # the launcher leads its own session: its local ranks are in the group
    except (ProcessLookupError, PermissionError):
        pass

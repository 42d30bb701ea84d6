"""Process checks with ``psutil`` (Linux and macOS): is a pid alive, which one is it, what started it.

A process is identified by its pid *and* its start time (``psutil``'s ``create_time``), so a
recycled pid is never mistaken for it. Every function answers "unknown" (None, ``{}``, ``""``)
rather than raising when the operating system refuses to tell.

Example::

    from mlx_train import processes
    me = os.getpid()
    processes.alive(me, processes.start_time(me))     # True
    processes.environ(me).get("HOME")
"""

from __future__ import annotations

import os
import signal

import psutil


def start_time(pid: int) -> float | None:
    """When ``pid`` started (Unix seconds), or None when there is no such process or it cannot be read."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError):
        return None


def alive(pid: object, started: float | None = None) -> bool:
    """True when ``pid`` runs and is not a zombie (and, if ``started`` is given, is the same process).

    Example: ``alive(os.getpid())`` is True; ``alive(pid_of_a_process_that_exited)`` is False.
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        process = psutil.Process(pid)
        if started is not None and abs(process.create_time() - float(started)) > 0.01:
            return False
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.AccessDenied:
        return True  # it exists; another user's process
    except (psutil.Error, ValueError, OverflowError):
        return False


def environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` runs with (empty when it cannot be read)."""
    try:
        return dict(psutil.Process(pid).environ())
    except (psutil.Error, OSError, ValueError):
        return {}


def cmdline(pid: int) -> str:
    """``pid``'s command line as one string (empty when it cannot be read)."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError, ValueError):
        return ""


def parent(pid: int) -> int | None:
    """``pid``'s parent process id, or None when unknown."""
    try:
        return psutil.Process(pid).ppid()
    except (psutil.Error, ValueError):
        return None


def pids() -> list[int]:
    """Every process id on this machine."""
    return psutil.pids()


def group_alive(pgid: int) -> bool:
    """True while a process of process group ``pgid`` (other than a zombie) exists."""
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to process group ``pgid`` (nothing when it is gone or not ours)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass

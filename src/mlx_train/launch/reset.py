"""``mlx-train reset-distributed``: clear stale distributed state and stop leftover processes.

Only processes of mlx-train runs are touched: those recorded in the registry (supervisors and
ranks, matched by pid *and* start time) and those started by an mlx-train supervisor (their
environment carries ``MLX_TRAIN_RUN_ID``). A process is a leftover when the supervisor recorded
for its run is gone, when its launcher is gone (it was orphaned), or when it has recorded a
failure; ``stop_running=True`` also stops runs that are still healthy. A run this registry
(``MLX_TRAIN_HOME``) knows nothing about is left alone unless orphaned, even with
``stop_running``: it belongs to another home (another user's or another test's runs on the
same machine). Each stopped process is named.

Example::

    for line in reset_distributed():
        print(line)        # "stopped pid 4242: rank 1 of run 20250101-120000-4100 (python train.py ...)"
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_train import processes, rundir
from mlx_train.distributed import environment as rank_env
from mlx_train.distributed import registry
from mlx_train.distributed.config import cluster_path
from mlx_train.distributed.hostfile import Hostfile
from mlx_train.errors import MLXTrainError


@dataclass
class Leftover:
    """A process of an mlx-train run, and why it counts as left over."""

    pid: int
    what: str
    why: str
    start_time: float | None = None


def _dead_supervisors() -> set[str]:
    """Runs whose supervisor was recorded here and is gone (killed before it could clean up)."""
    return {e["run_id"] for e in registry.entries() if e.get("kind") == "supervisor" and not e["alive"]}


def _orphaned(pid: int) -> bool:
    parent = processes.parent(pid)
    return parent is None or parent == 1 or not processes.alive(parent)


def _candidates() -> dict[int, dict[str, Any]]:
    """pid -> what is known of every live mlx-train process on this machine (registry + environment)."""
    found: dict[int, dict[str, Any]] = {}
    for entry in registry.entries():
        if entry["alive"] and entry.get("pid") not in (None, os.getpid()):
            found[int(entry["pid"])] = dict(entry)
    for pid in processes.pids():
        if pid in found or pid == os.getpid():
            continue
        env = processes.environ(pid)
        if rank_env.ENV_RUN_ID in env:
            found[pid] = {"pid": pid, "kind": "rank" if "MLX_RANK" in env else "launcher",
                          "run_id": env[rank_env.ENV_RUN_ID], "rank": env.get("MLX_RANK"),
                          "start_time": processes.start_time(pid), "run_dir": env.get(rank_env.ENV_RUN_DIR)}
    for pid, info in found.items():  # processes a rank started (a compiler, a data worker) inherit its marks
        parent = processes.parent(pid)
        if info.get("kind") == "rank" and parent in found and found[parent].get("kind") in ("rank", "child"):
            info["kind"], info["parent"] = "child", parent
    return found


def find_leftovers(stop_running: bool = False) -> list[Leftover]:
    """The mlx-train processes that ``reset_distributed`` would stop (nothing is stopped here)."""
    dead_runs = _dead_supervisors()
    known_runs = {e.get("run_id") for e in registry.entries() if e.get("run_id")}
    own = {os.getpid(), os.getppid()}
    leftovers = []
    for pid, info in sorted(_candidates().items()):
        if pid in own:
            continue
        kind, run_id = info.get("kind"), info.get("run_id")
        what = _name(pid, info)
        if stop_running and (run_id in known_runs or "path" in info):  # "path": a registry entry
            why = "requested (--all)"
        elif kind == "supervisor":
            continue  # a live supervisor is a run in progress
        elif run_id in dead_runs and kind in ("rank", "launcher", "child"):
            why = "its supervisor is gone"
        elif kind == "rank" and _orphaned(pid):
            why = "its launcher is gone (orphaned)"
        elif kind == "rank" and _failed(info):
            why = "it recorded a failure and is still running"
        else:
            continue
        leftovers.append(Leftover(pid, what, why, info.get("start_time")))
    return leftovers


def _failed(info: dict[str, Any]) -> bool:
    where = info.get("run_dir") or info.get("state_dir")
    beats = rundir.read_heartbeats(rundir.run_dir_of(where)) if where else {}
    rank = info.get("rank")
    beat = beats.get(int(rank)) if rank is not None and str(rank).isdigit() else None
    return bool(beat and beat.state == "failed" and beat.pid == info.get("pid"))


def _name(pid: int, info: dict[str, Any]) -> str:
    kind, rank = info.get("kind", "process"), info.get("rank")
    label = f"rank {rank}" if kind == "rank" and rank is not None else kind
    if kind == "child":
        label = f"child process of pid {info['parent']} (rank {rank})"
    run = f" of run {info['run_id']}" if info.get("run_id") else ""
    command = processes.cmdline(pid) or info.get("cmdline", "")
    return f"{label}{run} ({command[:100]})"


def _stop(leftover: Leftover, grace: float) -> bool:
    try:
        os.kill(leftover.pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not processes.alive(leftover.pid, leftover.start_time):
            return True
        time.sleep(0.05)
    try:
        os.kill(leftover.pid, signal.SIGKILL)  # also ends a stopped (SIGSTOP) process
    except ProcessLookupError:
        return True
    time.sleep(0.1)
    return not processes.alive(leftover.pid, leftover.start_time)


def reset_distributed(stop_running: bool = False, clear_config: bool = False, grace: float = 3.0) -> list[str]:
    """Stop leftover mlx-train processes, clear stale records (and the cluster configuration if asked).

    Returns one line per action, naming each process stopped and each file removed.
    """
    lines = []
    for leftover in find_leftovers(stop_running):
        if not processes.alive(leftover.pid, leftover.start_time):
            continue
        stopped = _stop(leftover, grace)
        state = "stopped" if stopped else "could not stop"
        lines.append(f"{state} pid {leftover.pid}: {leftover.what}; {leftover.why}")
    for entry in registry.entries():
        if not entry["alive"]:
            registry.unregister(Path(entry["path"]))
            run = f" of run {entry['run_id']}" if entry.get("run_id") else ""
            who = f"{entry.get('kind')} pid {entry.get('pid')}{run}"
            lines.append(f"removed the stale record of {who} ({entry['path']})")
    lines += _clear_config(clear_config)
    if not lines:
        lines.append("nothing to reset: no leftover mlx-train processes, no stale records")
    return lines


def _clear_config(clear: bool) -> list[str]:

    path = cluster_path()
    if not path.exists():
        return []
    if clear:
        path.unlink()
        return [f"removed the cluster configuration {path}"]
    try:
        Hostfile.read(path)
        return []
    except MLXTrainError as error:
        backup = path.with_name(f"{path.name}.invalid-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(path), backup)
        return [f"moved the invalid cluster configuration {path} to {backup} ({error})"]

"""Show the devices this machine can train on and the runs in progress: step, throughput and
how old each run's heartbeat is (a stale one is flagged). With the distributed module
installed, its view of the cluster too.

Example::

    from mlx_train.cli.status import device_lines, run_rows
    print("\\n".join(device_lines()))
    for row in run_rows("runs"):
        print(row)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

EPILOG = """examples:
  mlx-train status                 # devices, and runs in progress under ./runs
  mlx-train status --all           # finished and stopped runs too
  mlx-train status --runs /data/runs
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``status`` flags."""
    parser.add_argument("--runs", default="runs", metavar="DIR", help="where the run directories are (default: runs)")
    parser.add_argument("--all", action="store_true", help="list finished and stopped runs too")
    parser.add_argument("--stale-after", type=float, default=60.0, metavar="SECONDS",
                        help="flag a running rank whose heartbeat is older than this (default: 60)")


def device_lines() -> list[str]:
    """MLX version, backends, the default device with its memory limit, system memory."""
    import mlx.core as mx

    from mlx_train.device import DeviceConfig, available_backends, system_memory

    backends = available_backends()
    listed = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in backends.items())
    lines = [f"MLX {mx.__version__}; backends: {listed}"]  # type: ignore[attr-defined]  # not in the stubs
    try:
        lines.append(f"default device: {DeviceConfig().describe()}")
    except Exception as error:  # noqa: BLE001 - a status command reports, it does not fail
        lines.append(f"default device: could not be described ({type(error).__name__}: {error})")
    memory = system_memory()
    if memory:
        lines.append(f"system memory: {memory / 1e9:.1f} GB")
    return lines


def cluster_lines() -> list[str]:
    """What ``mlx_train.launch.describe_cluster()`` says, when that module and function exist."""
    try:
        module = importlib.import_module("mlx_train.launch")
    except ModuleNotFoundError as error:
        if error.name in ("mlx_train.launch", "mlx_train"):
            return []
        return [f"cluster: could not be described ({error})"]
    try:
        describe = getattr(module, "describe_cluster", None)
    except ImportError:  # named by a lazy attribute table, but its module is not there
        return []
    if not callable(describe):
        return []
    try:
        described = describe()
    except Exception as error:  # noqa: BLE001
        return [f"cluster: could not be described ({type(error).__name__}: {error})"]
    if isinstance(described, dict):
        return [f"{k}: {v}" for k, v in described.items()]
    if isinstance(described, (list, tuple)):
        return [str(x) for x in described]
    return str(described).splitlines()


def run_rows(root: str = "runs", include_all: bool = False, stale_after: float = 60.0) -> list[dict[str, Any]]:
    """One dict per run under ``root`` (newest activity last): only runs in progress (a rank still
    running, stale or not) unless ``include_all``.

    Keys: ``run`` (its path), ``name`` (relative to ``root``), ``state``, ``step``, ``total_steps``,
    ``steps_per_second``, ``samples_per_second``,
    ``heartbeat_age`` (seconds, the oldest rank's), ``ranks``, ``flagged`` (ranks stale or gone).
    """
    from mlx_train.monitor.run import RunReader, find_runs

    rows = []
    for path in find_runs(root):
        snap = RunReader(path, stale_after=stale_after).read()
        in_progress = any(r.status in ("running", "stale") for r in snap.ranks)
        if not (in_progress or include_all):
            continue
        latest = snap.latest
        rows.append({
            "run": str(path), "name": os.path.relpath(path, root), "state": snap.state, "step": snap.step,
            "total_steps": snap.total_steps,
            "steps_per_second": snap.steps_per_second, "samples_per_second": latest.get("samples_per_second"),
            "heartbeat_age": max((r.age for r in snap.ranks), default=None), "ranks": len(snap.ranks),
            "flagged": [r.rank for r in snap.ranks if r.flagged],
        })
    return rows


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train status`` from parsed arguments."""
    from rich import box
    from rich.console import Console, JustifyMethod
    from rich.markup import escape
    from rich.table import Table

    from mlx_train.monitor.dashboard import STATE_STYLES, format_age

    console = Console(file=sys.stdout, highlight=False)
    if not sys.stdout.isatty():  # a pipe or a file: 100 columns unless COLUMNS says otherwise
        columns = os.environ.get("COLUMNS", "")
        console.width = int(columns) if columns.isdigit() else 100
    console.print("[bold]devices[/bold]")
    for line in device_lines() + cluster_lines():
        console.print(f"  {line}", markup=False, soft_wrap=True)
    rows = run_rows(args.runs, args.all, args.stale_after)
    what = "runs" if args.all else "runs in progress"
    console.print(f"\n[bold]{what}[/bold] under {escape(args.runs)}/", soft_wrap=True)
    if not rows:
        hint = "" if args.all else " (--all lists finished and stopped runs too)"
        console.print(f"  none{hint}", markup=False)
        return 0
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
    headers: tuple[tuple[str, JustifyMethod], ...] = (
        ("run", "left"), ("state", "left"), ("step", "right"), ("steps/s", "right"), ("samples/s", "right"),
        ("heartbeat", "right"), ("ranks", "right"))
    for name, justify in headers:
        table.add_column(name, justify=justify, no_wrap=name != "run", overflow="fold",
                         min_width=12 if name == "run" else len(name))
    for row in rows:
        state = row["state"].upper() if row["flagged"] else row["state"]
        step = f"{row['step']}/{row['total_steps']}" if row["total_steps"] else str(row["step"])
        sps, samples, age = row["steps_per_second"], row["samples_per_second"], row["heartbeat_age"]
        table.add_row(escape(row["name"]), f"[{STATE_STYLES.get(row['state'], '')}]{state}[/]", step,
                      f"{sps:,.1f}" if sps else "-", f"{samples:,.0f}" if samples else "-",
                      format_age(age) if age is not None else "-", str(row["ranks"]))
    console.print(table)
    return 0

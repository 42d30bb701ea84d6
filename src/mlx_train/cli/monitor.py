"""Watch a training run live: progress and ETA, loss curves, learning rate, throughput,
memory per rank, the latest checkpoint, and a flag when a rank's heartbeat goes stale.

RUN_DIR is a run directory written by 'mlx-train train' (or by a Trainer with run_dir set);
without it, the run under ./runs that was active last. Ctrl-C quits. When the output is
not a terminal (or with --once), one snapshot is printed instead.

Example::

    from rich.console import Console
    from mlx_train.monitor import RunReader, render
    Console().print(render(RunReader("runs/a").read(), performance=True))
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

EPILOG = """examples:
  mlx-train monitor                         # the latest run under ./runs, refreshed every second
  mlx-train monitor runs/a --performance    # also: where step time goes
  mlx-train monitor runs/a --once           # one snapshot, for scripts and logs
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``monitor`` flags."""
    parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                        help="run directory (default: the run under --runs that was active last)")
    parser.add_argument("--performance", action="store_true",
                        help="add where step time goes: waiting for data, compute, gradient communication, "
                             "checkpointing")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between refreshes (default: 1)")
    parser.add_argument("--stale-after", type=float, default=60.0, metavar="SECONDS",
                        help="flag a running rank whose heartbeat is older than this; slow steps or long "
                             "validations raise the limit for that run (default: 60)")
    parser.add_argument("--runs", default="runs", metavar="DIR",
                        help="where to look for the latest run when RUN_DIR is left out (default: runs)")


def _console() -> Console:
    from rich.console import Console

    return Console(file=sys.stdout, highlight=False)


def watch(run_dir: str | None, performance: bool = False, interval: float = 1.0, runs: str = "runs",
          stale_after: float = 60.0) -> None:
    """Follow a run in the terminal (alternate screen) until Ctrl-C."""
    from rich.live import Live

    from mlx_train.monitor import RunReader, render, resolve_run_dir

    reader = RunReader(resolve_run_dir(run_dir, runs), stale_after=stale_after)
    console = _console()

    def screen() -> RenderableType:
        size = console.size
        return render(reader.read(), performance=performance, width=size.width, height=size.height,
                      footer=f" · every {interval:g}s · Ctrl-C quits")

    with Live(screen(), console=console, screen=True, auto_refresh=False, transient=True) as live:
        try:
            while True:
                time.sleep(max(interval, 0.05))
                live.update(screen(), refresh=True)
        except KeyboardInterrupt:
            pass


def main(args: argparse.Namespace) -> int:
    """Run ``mlx-train monitor`` from parsed arguments."""
    from mlx_train.errors import ConfigError
    from mlx_train.monitor import RunReader, render, resolve_run_dir

    if args.interval <= 0:
        raise ConfigError(f"--interval must be a positive number of seconds, got {args.interval}")
    if sys.stdout.isatty() and not args.once:
        watch(args.run_dir, args.performance, args.interval, args.runs, args.stale_after)
        return 0
    reader = RunReader(resolve_run_dir(args.run_dir, args.runs), stale_after=args.stale_after)
    console = _console()
    if not sys.stdout.isatty():  # a pipe or a file: 100 columns unless COLUMNS says otherwise
        columns = os.environ.get("COLUMNS", "")
        console.width = int(columns) if columns.isdigit() else 100
    console.print(render(reader.read(), performance=args.performance, width=console.width))
    return 0

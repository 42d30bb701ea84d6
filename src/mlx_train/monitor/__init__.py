"""Watching runs: read a run directory, draw it in the terminal, plot it.

Example::

    from mlx_train.monitor import RunReader, latest_run, render
    snap = RunReader(latest_run("runs")).read()
    print(snap.step, snap.total_steps, snap.state, snap.latest.get("loss"))
"""

from mlx_train.monitor.chart import Series, line_chart
from mlx_train.monitor.dashboard import render
from mlx_train.monitor.run import (
    RankStatus,
    RunReader,
    RunSnapshot,
    find_runs,
    latest_run,
    rank_status,
    resolve_run_dir,
)

__all__ = ["RankStatus", "RunReader", "RunSnapshot", "Series", "find_runs", "latest_run", "line_chart",
           "rank_status", "render", "resolve_run_dir"]

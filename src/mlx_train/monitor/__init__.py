"""Watching runs: read a run directory, draw it in the terminal, plot it.

Example::

    from mlx_train.monitor import RunReader, latest_run, render
    snap = RunReader(latest_run("runs")).read()
    print(snap.step, snap.total_steps, snap.state, snap.latest.get("loss"))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

if TYPE_CHECKING:
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

_LAZY = {
    "Series": "mlx_train.monitor.chart",
    "line_chart": "mlx_train.monitor.chart",
    "render": "mlx_train.monitor.dashboard",
    "RankStatus": "mlx_train.monitor.run",
    "RunReader": "mlx_train.monitor.run",
    "RunSnapshot": "mlx_train.monitor.run",
    "find_runs": "mlx_train.monitor.run",
    "latest_run": "mlx_train.monitor.run",
    "rank_status": "mlx_train.monitor.run",
    "resolve_run_dir": "mlx_train.monitor.run",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["RankStatus", "RunReader", "RunSnapshot", "Series", "find_runs", "latest_run", "line_chart",
           "rank_status", "render", "resolve_run_dir"]

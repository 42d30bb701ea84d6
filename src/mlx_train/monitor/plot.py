"""Curves of a run as an image (needs ``pip install 'mlx-train[plot]'``: matplotlib).

One panel per kind of curve, one line per series, against the optimizer step: loss (train
reports, validation), other validation metrics, learning rate, throughput, gradient norm, peak
memory, and the step-time breakdown. Panels without data are left out.

Example::

    from mlx_train.monitor.plot import plot_run
    figure = plot_run("runs/a", "runs/a/curves.png")
    [ax.get_title() for ax in figure.axes]       # ["loss", "validation metrics", "learning rate", ...]
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mlx_train.errors import ConfigError, did_you_mean
from mlx_train.monitor.run import RunReader, RunSnapshot, resolve_run_dir
from mlx_train.paths import writable_file

if TYPE_CHECKING:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

# (panel title, y label, [(series label, metrics key), ...]); val_* keys beyond val_loss are added.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("loss", "loss", [("train loss", "loss"), ("val loss", "val_loss")]),
    ("validation metrics", "value", []),
    ("learning rate", "learning rate", [("learning rate", "learning_rate")]),
    ("throughput", "per second", [("samples/s", "samples_per_second"), ("tokens/s", "tokens_per_second")]),
    ("gradient norm", "global L2 norm", [("grad norm", "grad_norm")]),
    ("peak memory", "GB", [("peak memory", "peak_memory_gb")]),
    ("step time", "ms per step", [("step time", "step_time"), ("data", "time_data"), ("compute", "time_compute"),
                                  ("communication", "time_comm"), ("checkpointing", "time_checkpoint")]),
]
MILLISECONDS = {"step_time", "time_data", "time_compute", "time_comm", "time_checkpoint"}


def _require_matplotlib() -> tuple[type[Figure], type[FigureCanvasAgg]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ConfigError(f"plotting needs matplotlib, which is not installed ({error}): "
                          "pip install 'mlx-train[plot]'") from None
    return Figure, FigureCanvasAgg


def panels_for(snap: RunSnapshot, keys: Sequence[str] | None = None) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """The panels that have data (restricted to metrics ``keys`` when given)."""
    val_keys = sorted({k for row in snap.val for k in row
                       if k.startswith("val_") and k not in ("val_loss", "val_time")})
    chosen = []
    for title, y_label, series in PANELS:
        if title == "validation metrics":
            series = [(k.replace("_", " "), k) for k in val_keys]
        series = [(label, key) for label, key in series
                  if (keys is None or key in keys) and snap.series(key)[0]]
        if series:
            chosen.append((title, y_label, series))
    return chosen


def plot_run(run_dir: str | os.PathLike[str], output: str | os.PathLike[str] | None = None,
             keys: Sequence[str] | None = None, dpi: int = 100) -> Figure:
    """Draw the run's curves into a matplotlib Figure; save it to ``output`` (png, svg, pdf) if given.

    ``keys`` restricts the series to those metrics (e.g. ``["loss", "val_loss"]``).
    """
    Figure, FigureCanvasAgg = _require_matplotlib()
    path = None if output is None else writable_file(output, "the plot's output")  # before any drawing
    snap = RunReader(resolve_run_dir(run_dir)).read()
    if keys:
        plottable = sorted({key for _, _, series in PANELS for _, key in series}
                           | {k for row in snap.val for k in row if k.startswith("val_") and k != "val_time"})
        present = [key for key in plottable if snap.series(key)[0]]
        unknown = [key for key in keys if key not in plottable]
        if unknown:
            raise ConfigError(f"unknown metric{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
                              f"{did_you_mean(unknown[0], plottable)}; {run_dir} has "
                              f"{', '.join(present) or 'no metrics yet'} (--metrics takes a comma-separated list)")
    panels = panels_for(snap, keys)
    if not panels:
        wanted = f" among {', '.join(keys)}" if keys else ""
        raise ConfigError(f"{run_dir} has no metrics to plot{wanted} yet: metrics.jsonl gets its first row at "
                          "the first report (report_every)")
    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6.4 * columns, 3.2 * rows), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(snap.run_dir)
    for i, (title, y_label, series) in enumerate(panels):
        ax = figure.add_subplot(rows, columns, i + 1)
        for label, key in series:
            steps, values = snap.series(key)
            if key in MILLISECONDS:
                values = [v * 1e3 for v in values]
            ax.plot(steps, values, label=label, marker="o" if len(steps) < 30 and key.startswith("val_") else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(y_label)
        if title in ("loss", "learning rate") and all(v > 0 for _, k in series for v in snap.series(k)[1]):
            values = [v for _, k in series for v in snap.series(k)[1]]
            if max(values) / min(values) > 50:
                ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    if path is not None:
        try:
            figure.savefig(path)
        except ValueError as error:  # an unknown extension
            raise ConfigError(f"cannot write {path}: {error}; use .png, .svg or .pdf") from None
    return figure

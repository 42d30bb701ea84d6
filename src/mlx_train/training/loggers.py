"""Progress display and the run directory's metrics files (names and writing from ``mlx_train.rundir``)."""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from mlx_train import rundir
from mlx_train.config import parse_every
from mlx_train.training.callbacks import Callback

if TYPE_CHECKING:
    from mlx_train.training.trainer import Trainer


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def format_report(logs: dict[str, Any]) -> str:
    """One line for a training report, as mlx-lm users expect to read it."""
    tokens = f"{_rate(logs['tokens_per_second'])} tok/s | " if "tokens_per_second" in logs else ""
    grad_norm = f" | grad_norm {logs['grad_norm']:.3f}" if logs.get("grad_norm") else ""
    return (f"step {logs['step']} | epoch {logs['epoch'] + 1} | loss {logs['loss']:.4f} | "
            f"lr {logs['learning_rate']:.3e} | {tokens}{_rate(logs['samples_per_second'])} samples/s{grad_norm} | "
            f"peak mem {logs['peak_memory_gb']:.3f} GB")


def _rate(value: float) -> str:
    """A speed with the digits that matter: 2791, 12.4, 0.52 (a slow LLM step is not "0 samples/s")."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def format_validation(logs: dict[str, Any]) -> str:
    """One line for a validation run between epochs (``eval_every="N steps"``)."""
    shown = [f"{k} {_fmt(v)}" for k, v in logs.items() if k not in ("step", "epoch", "val_time")]
    return f"step {logs['step']} | validation: {'  '.join(shown)}  ({logs.get('val_time', 0.0):.1f}s)"


def format_epoch(epoch: int, epochs: int | None, logs: dict[str, Any], seconds: float) -> str:
    shown = {k: v for k, v in logs.items() if k not in ("epoch", "step")}
    body = "  ".join(f"{k} {_fmt(v)}" for k, v in shown.items())
    total = f"/{epochs}" if epochs else ""
    return f"epoch {epoch + 1}{total}: {body}  ({seconds:.1f}s)"


class ProgressBar(Callback):
    """Live rich progress bar in a terminal; plain report lines when output is not a TTY.

    Example::

        trainer.train(data, callbacks=[ProgressBar()])   # added by default
    """

    def __init__(self, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self._progress: Any = None  # a rich Progress while live
        self._task: Any = None
        self._epoch_start = time.perf_counter()

    def on_fit_start(self, trainer: Trainer) -> None:
        if not self.live:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
            console=Console(file=self.stream), transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=trainer.total_steps, epoch=1, info="",
                                             completed=trainer.step)

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        self._epoch_start = time.perf_counter()

    def on_report(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        if self._progress is not None:
            info = (f"loss {logs['loss']:.4f}  lr {logs['learning_rate']:.2e}  "
                    f"{logs['samples_per_second']:.0f} samples/s")
            self._progress.update(self._task, completed=logs["step"], epoch=logs["epoch"] + 1, info=info)
        else:
            self.stream.write(format_report(logs) + "\n")  # one write and a flush: a report is one line
            self.stream.flush()

    def on_validation_end(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        if parse_every(trainer.config.eval_every).unit != "step":
            return  # validation at an epoch's end shows in the epoch line
        self._print(format_validation(logs))

    def _print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line)
        else:
            self.stream.write(line + "\n")  # one write and a flush, as a report line
            self.stream.flush()

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, Any]) -> None:
        line = format_epoch(epoch, trainer.epochs, logs, time.perf_counter() - self._epoch_start)
        if self._progress is not None:
            self._progress.update(self._task, completed=trainer.step)
        self._print(line)

    def on_fit_end(self, trainer: Trainer, history: dict[str, Any]) -> None:
        self._stop()

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class MetricsLogger(Callback):
    """Appends every report, validation and epoch summary to ``metrics.jsonl`` and ``metrics.csv``
    (and writes the Trainer's config to ``config.yaml`` when training starts).

    Each line of ``metrics.jsonl`` is one JSON object with ``"kind"`` (``train``, ``val`` or
    ``epoch``), ``step``, ``epoch``, ``time`` and the metrics. ``metrics.csv`` has the same rows
    with the union of columns seen so far (rewritten when a new column appears). A write the disk
    refuses during training warns once (``rundir.RunFileWarning``) and training goes on; once the
    files can be written again they are rewritten whole, with the rows they missed.

    Example::

        trainer.train(data, callbacks=[MetricsLogger("runs/exp1")])
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.jsonl_path = os.path.join(run_dir, rundir.METRICS_FILE)
        self.csv_path = os.path.join(run_dir, rundir.METRICS_CSV)
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = []
        self._behind = False  # a write failed: the files miss rows until they are rewritten whole

    def on_fit_start(self, trainer: Trainer) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        rundir.reset_write_failed(self.run_dir)  # a new run: its first failed write is reported
        config = getattr(trainer, "config", None)
        if config is not None:  # the config this run actually uses, for the monitor and for people
            rundir.write_config(self.run_dir, config)  # atomic: a resume after a kill may need it
        if trainer.step == 0:
            for path in (self.jsonl_path, self.csv_path):
                if os.path.exists(path):
                    os.remove(path)
        elif os.path.exists(self.jsonl_path):
            # Resumed: keep the lines up to the checkpoint's step; later ones are re-done.
            with open(self.jsonl_path) as f:
                rows = [row for row in map(_parse_row, f) if row is not None]
            self._rows = [r for r in rows if r.get("step", 0) <= trainer.step]
            self._rewrite()

    @classmethod
    def append(cls, run_dir: str, kind: str, logs: dict[str, Any]) -> None:
        """Add one row to a finished run's files (what the run wrote stays; both files rewritten whole).

        Example: ``MetricsLogger.append("runs/a", "val", {"step": 200, "epoch": 0, "val_loss": 1.9})``.
        """
        logger = cls(run_dir)
        if os.path.exists(logger.jsonl_path):
            with open(logger.jsonl_path) as f:
                logger._rows = [row for row in map(_parse_row, f) if row is not None]
        logger._rows.append({"kind": kind, "time": time.time(), **logs})
        logger._rewrite()

    def _write(self, kind: str, logs: dict[str, Any]) -> None:
        row = {"kind": kind, "time": time.time(), **logs}
        self._rows.append(row)
        if self._behind:
            self._rewrite()
            return
        wrote = rundir.write_run_file(self.jsonl_path, json.dumps(row) + "\n", append=True)
        if any(k not in self._columns for k in row):
            wrote = self._rewrite_csv() and wrote
        else:
            wrote = rundir.write_run_file(self.csv_path, _csv_text(self._columns, [row]), append=True) and wrote
        self._behind = not wrote

    def _rewrite(self) -> None:
        """Both files whole from the rows kept (atomic; like the appended rows, not fsync'ed)."""
        wrote = rundir.write_run_file(self.jsonl_path, "".join(json.dumps(r) + "\n" for r in self._rows))
        self._behind = not (self._rewrite_csv() and wrote)

    def _rewrite_csv(self) -> bool:
        for r in self._rows:
            self._columns += [k for k in r if k not in self._columns]
        return rundir.write_run_file(self.csv_path, _csv_text(self._columns, self._rows, header=True))

    def on_report(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        self._write("train", logs)

    def on_validation_end(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        self._write("val", logs)

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, Any]) -> None:
        self._write("epoch", {"step": trainer.step, "epoch": epoch, **logs})


def _csv_text(columns: list[str], rows: list[dict[str, Any]], header: bool = False) -> str:
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def _parse_row(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl row; None for a blank line or one torn by a kill mid-write (it is re-done)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None

"""TensorBoard event files from a training run (needs ``pip install 'mlx-train[tensorboard]'``).

Scalars, against the optimizer step: ``train/<metric>`` at every report (loss, learning_rate,
samples_per_second, grad_norm, peak_memory_gb, step_time, ...), ``val/<metric>`` after each
validation (``val_loss`` becomes ``val/loss``) and ``epoch/<metric>`` at the end of each epoch.
Only the main process writes. After a resume, TensorBoard drops the points the interrupted run
had logged past the checkpoint, so the curves do not fold back on themselves.

Example::

    from mlx_train.training import TensorBoardLogger
    trainer.train(data, callbacks=[TensorBoardLogger("runs/a/tensorboard")])
    # then: tensorboard --logdir runs
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from mlx_train import rundir
from mlx_train.errors import ConfigError
from mlx_train.training.callbacks import Callback

if TYPE_CHECKING:
    from mlx_train.training.trainer import Trainer

SKIPPED = frozenset({"step", "epoch", "trained_samples"})


def _require_tensorboard() -> Any:
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as error:
        raise ConfigError(
            f"TensorBoardLogger needs the tensorboard package, which is not installed ({error}): "
            "pip install 'mlx-train[tensorboard]'"
        ) from None
    return event_pb2, summary_pb2, EventFileWriter


class TensorBoardLogger(Callback):
    """Writes the run's metrics as TensorBoard scalars.

    ``log_dir`` defaults to ``<run_dir>/tensorboard`` (the Trainer's ``run_dir``). Events are
    flushed every ``flush_seconds``, after each validation and at the end.
    """

    def __init__(self, log_dir: str | None = None, flush_seconds: float = 10.0) -> None:
        self._event_pb2, self._summary_pb2, self._writer_class = _require_tensorboard()
        self.log_dir, self.flush_seconds = log_dir, flush_seconds
        self._writer: Any = None  # tensorboard's EventFileWriter while fitting

    def on_fit_start(self, trainer: Trainer) -> None:
        if not getattr(trainer, "is_main", True):
            return
        log_dir = self.log_dir
        if log_dir is None:
            run_dir = trainer.config.run_dir
            if not run_dir:
                raise ConfigError("TensorBoardLogger needs a directory: pass TensorBoardLogger(log_dir=...) "
                                  "or set run_dir in the Trainer's config (it then writes to RUN_DIR/tensorboard)")
            log_dir = os.path.join(run_dir, rundir.TENSORBOARD_DIR)
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self._writer = self._writer_class(log_dir, flush_secs=self.flush_seconds)
        if trainer.step > 0:  # resumed: points logged after the checkpoint are out of date
            log = self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)
            self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=trainer.step + 1,
                                                         session_log=log))

    def on_report(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        self.write_scalars("train", logs, trainer.step)

    def on_validation_end(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        self.write_scalars("val", {k.removeprefix("val_"): v for k, v in logs.items()}, trainer.step)
        if self._writer is not None:
            self._writer.flush()

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, Any]) -> None:
        self.write_scalars("epoch", logs, trainer.step)

    def on_fit_end(self, trainer: Trainer, history: dict[str, Any]) -> None:
        self.close()

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        self.close()

    def write_scalars(self, prefix: str, values: dict[str, Any], step: int) -> None:
        """Add ``prefix/name`` scalars for the numeric entries of ``values`` at ``step``."""
        if self._writer is None:
            return
        summary = self._summary_pb2.Summary(value=[
            self._summary_pb2.Summary.Value(tag=f"{prefix}/{name}", simple_value=float(value))
            for name, value in values.items()
            if name not in SKIPPED and isinstance(value, (int, float)) and not isinstance(value, bool)
        ])
        if summary.value:
            self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        """Flush and close the event file (training closes it at the end)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

"""A per-rank heartbeat file in the run directory, for ``mlx-train monitor``, ``status`` and the supervisor.

Every process of a run keeps ``RUN_DIR/heartbeat-<rank>.json`` (rank from ``trainer.group``), in
the one schema of ``mlx_train.rundir.HeartbeatRecord``: step, epoch, time, throughput, memory and
the step-time breakdown of the last report, plus a ``state`` (``starting``, ``running``,
``validating``, ``checkpointing``, ``finished``, ``failed``, ``interrupted``). It is rewritten
atomically at most every ``interval`` seconds while training, and at once when the state
changes. A distributed rank's monitor writes the same file (one file per rank). A live rank whose
file stops changing is stale (``rundir.is_stale``): the monitor flags it.

Example::

    trainer.train(data, callbacks=[Heartbeat("runs/a", interval=2.0)])   # added when run_dir is set
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_train import rundir
from mlx_train.errors import TrainingInterrupted
from mlx_train.training.callbacks import Callback

if TYPE_CHECKING:
    from mlx_train.training.trainer import Trainer

HEARTBEAT_PREFIX = rundir.HEARTBEAT_PREFIX
TIMING_KEYS = ("step_time", "time_data", "time_compute", "time_comm", "time_checkpoint")


def heartbeat_path(run_dir: str, rank: int) -> str:
    """``heartbeat_path("runs/a", 1) == "runs/a/heartbeat-1.json"``."""
    return str(rundir.heartbeat_path(run_dir, rank))


class Heartbeat(Callback):
    """Writes ``heartbeat-<rank>.json`` into ``run_dir`` while training (every rank).

    ``interval`` is the shortest time between two writes during training (the check itself is
    one clock read per step).
    """

    def __init__(self, run_dir: str, interval: float = 2.0) -> None:
        self.run_dir, self.interval = run_dir, float(interval)
        self.rank, self.world_size = 0, 1
        self.path = heartbeat_path(run_dir, 0)
        self._next = 0.0
        self._info: dict[str, Any] = {}
        self._anchor: tuple[float, int] | None = None
        self._writer: rundir.HeartbeatWriter | None = None

    # -- events -------------------------------------------------------------------------

    def on_fit_start(self, trainer: Trainer) -> None:
        group = getattr(trainer, "group", None)
        self.rank, self.world_size = (group.rank(), group.size()) if group is not None else (0, 1)
        self.path = heartbeat_path(self.run_dir, self.rank)
        self._writer = rundir.HeartbeatWriter.of(self.run_dir, self.rank)
        self._info = {"start_step": trainer.step, "peak_memory_gb": 0.0}
        self._writer.update(write=False, started=time.time(), error=None, error_type=None)
        self._anchor = None
        self.beat(trainer, "running")

    def on_batch_end(self, trainer: Trainer, step: int) -> None:
        if time.perf_counter() >= self._next:
            self.beat(trainer)

    def on_report(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        world = self.world_size
        info = self._info
        info["samples_per_second"] = logs["samples_per_second"] / world
        if "tokens_per_second" in logs:
            info["tokens_per_second"] = logs["tokens_per_second"] / world
        info["loss"] = logs["loss"]
        info["peak_memory_gb"] = max(info["peak_memory_gb"], logs["peak_memory_gb"])
        info["timing"] = {k: logs[k] for k in TIMING_KEYS if k in logs}

    def on_validation_end(self, trainer: Trainer, logs: dict[str, Any]) -> None:
        self._info["val_time"] = logs.get("val_time")
        self.beat(trainer)

    def on_checkpoint(self, trainer: Trainer, path: str) -> None:
        self._info["last_checkpoint"] = str(path)
        self.beat(trainer)

    def on_fit_end(self, trainer: Trainer, history: dict[str, Any]) -> None:
        self.beat(trainer, "finished")

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        state = "interrupted" if isinstance(error, (KeyboardInterrupt, TrainingInterrupted)) else "failed"
        # A rank stopped by the group's vote records no error: the one the signal reached says what stopped it.
        voted = isinstance(error, TrainingInterrupted) and not error.received
        self.beat(trainer, state, None if voted else error)

    # -- writing ------------------------------------------------------------------------

    def beat(self, trainer: Trainer, state: str = "running", error: BaseException | None = None) -> None:
        """Write the heartbeat file now (atomically: a reader never sees half a file).

        ``state`` is one of ``rundir.STATES``: e.g. ``beat(trainer, "validating")`` before a long evaluation.
        """
        if self._writer is None:
            self._writer = rundir.HeartbeatWriter.of(self.run_dir, self.rank)
        now, step = time.time(), trainer.step
        if self._anchor is None or step < self._anchor[1]:
            self._anchor = (now, step)
        elif now - self._anchor[0] >= self.interval:  # a rate over at least one interval
            self._info["steps_per_second"] = (step - self._anchor[1]) / (now - self._anchor[0])
            self._anchor = (now, step)
        fields: dict[str, Any] = {
            "state": state, "world_size": self.world_size, "step": step, "epoch": trainer.epoch,
            "epochs": trainer.epochs, "total_steps": trainer.total_steps,
            "active_memory_gb": mx.get_active_memory() / 1e9, "cache_memory_gb": mx.get_cache_memory() / 1e9,
            **self._info,
        }
        fields["peak_memory_gb"] = max(fields["peak_memory_gb"], mx.get_peak_memory() / 1e9)
        if not self._writer.record.steady:  # a rank monitor's thread writes more often: its interval stands
            fields["interval"] = self.interval
        if error is not None:
            fields["error"], fields["error_type"] = f"{type(error).__name__}: {error}", type(error).__name__
        self._writer.update(**fields)
        self._next = time.perf_counter() + self.interval

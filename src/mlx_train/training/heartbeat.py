"""A per-rank heartbeat file in the run directory, for ``mlx-train monitor`` and ``status``.

Every process of a run writes ``RUN_DIR/heartbeat-<rank>.json`` (rank from ``trainer.group``):
step, epoch, time, throughput, memory and the step-time breakdown of the last report, plus a
``state`` (``running``, ``finished``, ``failed``, ``interrupted``). It is rewritten atomically at
most every ``interval`` seconds while training, and at once when the state changes. A running
rank whose file stops changing is stale: the monitor flags it.

Example::

    trainer.train(data, callbacks=[Heartbeat("runs/a", interval=2.0)])   # added when run_dir is set
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import mlx.core as mx

from mlx_train.training.callbacks import Callback

HEARTBEAT_PREFIX = "heartbeat-"
TIMING_KEYS = ("step_time", "time_data", "time_compute", "time_comm", "time_checkpoint")


def heartbeat_path(run_dir: str, rank: int) -> str:
    """``heartbeat_path("runs/a", 1) == "runs/a/heartbeat-1.json"``."""
    return os.path.join(run_dir, f"{HEARTBEAT_PREFIX}{rank}.json")


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

    # -- events -------------------------------------------------------------------------

    def on_fit_start(self, trainer) -> None:
        group = getattr(trainer, "group", None)
        self.rank, self.world_size = (group.rank(), group.size()) if group is not None else (0, 1)
        self.path = heartbeat_path(self.run_dir, self.rank)
        os.makedirs(self.run_dir, exist_ok=True)
        self._info = {"started": time.time(), "start_step": trainer.step, "peak_memory_gb": 0.0}
        self._anchor = None
        self.beat(trainer, "running")

    def on_batch_end(self, trainer, step: int) -> None:
        if time.perf_counter() >= self._next:
            self.beat(trainer)

    def on_report(self, trainer, logs: dict) -> None:
        world = self.world_size
        info = self._info
        info["samples_per_second"] = logs["samples_per_second"] / world
        if "tokens_per_second" in logs:
            info["tokens_per_second"] = logs["tokens_per_second"] / world
        info["loss"] = logs["loss"]
        info["peak_memory_gb"] = max(info["peak_memory_gb"], logs["peak_memory_gb"])
        info["timing"] = {k: logs[k] for k in TIMING_KEYS if k in logs}

    def on_validation_end(self, trainer, logs: dict) -> None:
        self._info["val_time"] = logs.get("val_time")
        self.beat(trainer)

    def on_checkpoint(self, trainer, path: str) -> None:
        self._info["last_checkpoint"] = str(path)
        self.beat(trainer)

    def on_fit_end(self, trainer, history: dict) -> None:
        self.beat(trainer, "finished")

    def on_exception(self, trainer, error: BaseException) -> None:
        state = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        self._info["error"] = f"{type(error).__name__}: {error}"
        self.beat(trainer, state)

    # -- writing ------------------------------------------------------------------------

    def beat(self, trainer, state: str = "running") -> None:
        """Write the heartbeat file now (atomically: a reader never sees half a file)."""
        now, step = time.time(), trainer.step
        if self._anchor is None or step < self._anchor[1]:
            self._anchor = (now, step)
        elif now - self._anchor[0] >= self.interval:  # a rate over at least one interval
            self._info["steps_per_second"] = (step - self._anchor[1]) / (now - self._anchor[0])
            self._anchor = (now, step)
        record = {
            "rank": self.rank, "world_size": self.world_size, "host": socket.gethostname(), "pid": os.getpid(),
            "state": state, "time": now, "interval": self.interval, "step": step, "epoch": trainer.epoch,
            "epochs": trainer.epochs, "total_steps": trainer.total_steps,
            "active_memory_gb": mx.get_active_memory() / 1e9, "cache_memory_gb": mx.get_cache_memory() / 1e9,
            **self._info,
        }
        record["peak_memory_gb"] = max(record["peak_memory_gb"], mx.get_peak_memory() / 1e9)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full disk must not stop training; the monitor shows the heartbeat going stale
        self._next = time.perf_counter() + self.interval

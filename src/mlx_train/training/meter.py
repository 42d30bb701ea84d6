"""Metering between reports: speed, where the step time went, and the report window's loss.

The ``Meter`` only measures, and only reads the loop state: it is handed the window's loss sums already
summed over ranks, so no collective hides in it, and its clock is injectable, so tests need no sleeps.

Example::

    meter = Meter(state, world_size=1, clock=fake_clock)
    for batch in meter.timed(loader):
        running = step(state, batch)
        state.advance(running, meter.count(batch))
    window = report_window(totals, state.report_base)
    logs = meter.report(window, learning_rate=1e-3)
    state.close_window(totals, window["items"])

The window's loss is read from the step's window sums (``window:loss_sum``, ``window:items``) when the
totals hold them: exact, where a difference of two large float32 epoch sums would lose precision.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import mlx.core as mx

from mlx_train.training.losses import METRIC_PREFIX, WINDOW_PREFIX, batch_size_of, metric_means


class Meter:
    """Counts samples and train time (validation and saving left out) between reports.

    It splits the step time: waiting for the loader (``timed``), checkpoint saves
    (``resume(checkpoint=True)``) and the rest, the step itself. Validation counts in none of them. It
    never writes the loop state: ``count`` returns the samples the loop's step transition
    (``LoopState.advance``) adds up, and the steps and samples since the last report are read from the
    loop state at the report (nothing is counted per step but the wait for data).
    """

    def __init__(self, state: Any, world_size: int = 1, clock: Callable[[], float] = time.perf_counter,
                 peak_memory: Callable[[], int] = mx.get_peak_memory,
                 reset_peak: Callable[[], None] = mx.reset_peak_memory) -> None:
        self.state, self.world_size, self.clock = state, world_size, clock
        self.peak_memory, self.reset_peak = peak_memory, reset_peak
        self.start = clock()
        self.paused = 0.0
        self._since = (state.step, state.trained_samples)  # the loop state at the last report
        self.data_seconds = self.checkpoint_seconds = 0.0
        self.comm_seconds = 0.0  # per step, estimated by distributed training (it happens inside the step)
        #: Per step, reported with time_comm where distributed training counts them: ``comm_collectives``
        #: (collective calls) and ``comm_bytes`` (bytes given to them by each rank).
        self.comm_counts: dict[str, float] = {}
        self._pause_start = self.start
        reset_peak()

    def timed(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``loader``, adding the time spent waiting for each batch to ``data_seconds``."""
        clock = self.clock
        start = clock()
        iterator = iter(loader)
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                self.data_seconds += clock() - start
                return
            self.data_seconds += clock() - start
            yield batch
            start = clock()

    def count(self, batch: Any) -> int:
        """The samples of ``batch`` over all ranks (one optimizer step on it was dispatched)."""
        return (len(batch[0]) if type(batch) is tuple else batch_size_of(batch)) * self.world_size

    @property
    def pending_steps(self) -> int:
        """Steps since the last report."""
        return int(self.state.step - self._since[0])

    def pause(self) -> None:
        self._pause_start = self.clock()

    def resume(self, checkpoint: bool = False) -> None:
        seconds = self.clock() - self._pause_start
        self.paused += seconds
        if checkpoint:
            self.checkpoint_seconds += seconds

    @property
    def pending(self) -> bool:
        """Steps ran since the last report."""
        return self.pending_steps > 0

    def report(self, window: dict[str, float], learning_rate: float,
               grad_norm: float | None = None) -> dict[str, Any]:
        """The report's logs, from ``window``: the loss, item and metric sums since the last report, summed over
        ranks (``report_window``); each metric is reported as its mean over the window's items. Starts the
        meter's next window; the loop state's (``LoopState.close_window``) is the caller's to start."""
        state, now = self.state, self.clock()
        seconds = max(now - self.start - self.paused, 1e-9)
        d_items = window["items"]
        steps, samples = self.pending_steps, state.trained_samples - self._since[1]
        logs = {
            "step": state.step,
            "epoch": state.epoch,
            "loss": window["loss_sum"] / max(d_items, 1e-9),
            "learning_rate": learning_rate,
            "samples_per_second": samples / seconds,
            "steps_per_second": steps / seconds,
            "trained_samples": state.trained_samples,
            "peak_memory_gb": self.peak_memory() / 1e9,
        }
        if len(window) > 2:  # more than the loss and item sums: a loss's metrics
            logs.update(metric_means(window, d_items))
        if d_items > samples * 1.5:  # sequences: items are tokens
            logs["tokens_per_second"] = d_items / seconds
            logs["trained_tokens"] = state.trained_items + d_items
        if grad_norm is not None:
            logs["grad_norm"] = grad_norm
        self._add_step_times(logs, seconds, steps)
        self._since = (state.step, state.trained_samples)
        self.start, self.paused = now, 0.0
        self.data_seconds = self.checkpoint_seconds = 0.0
        self.reset_peak()
        return logs

    def _add_step_times(self, logs: dict[str, Any], train_seconds: float, steps: int) -> None:
        """Add the seconds per optimizer step since the last report to ``logs``: the wall time and where it went
        (what is not waiting for data, saving or, estimated, communicating is the step's compute)."""
        steps = max(steps, 1)
        step = max(train_seconds - self.data_seconds, 0.0) / steps
        comm = min(max(self.comm_seconds, 0.0), step)
        logs["step_time"] = (train_seconds + self.checkpoint_seconds) / steps
        logs["time_data"] = self.data_seconds / steps
        logs["time_compute"] = step - comm
        logs["time_comm"] = comm
        logs.update(self.comm_counts)
        logs["time_checkpoint"] = self.checkpoint_seconds / steps


def report_window(totals: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """The loss, item and metric sums since the last report: the step's window sums (``window:<key>``), or,
    from a step that keeps none, the epoch sums less their values at the last report (``base``).

    Example::

        report_window({"loss_sum": 9.0, "items": 3.0, "window:loss_sum": 2.0, "window:items": 1.0}, base)
        # {"loss_sum": 2.0, "items": 1.0}
    """
    if WINDOW_PREFIX + "items" in totals:
        return {k.removeprefix(WINDOW_PREFIX): v for k, v in totals.items() if k.startswith(WINDOW_PREFIX)}
    return {k: v - base.get(k, 0.0) for k, v in totals.items() if k == "loss_sum" or k == "items"
            or k.startswith(METRIC_PREFIX)}

"""Stopping cleanly on SIGTERM and SIGINT (preemption, Ctrl-C).

The first signal asks the loop to stop after the current step: it then saves a checkpoint,
waits for pending saves and raises ``TrainingInterrupted`` (exit code 143 or 130). A second
signal stops at once. Handlers are installed only in the main thread and only while training;
the previous ones are put back afterwards.

Example::

    with StopSignals(log=print) as signals:
        for batch in loader:
            ...
            if signals.requested:
                break
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from mlx_train.errors import TrainingInterrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Records the first SIGTERM/SIGINT (``requested``: its number, or None); a second one raises
    ``TrainingInterrupted`` immediately."""

    def __init__(self, log: Callable[[str], None] = print, step: Callable[[], int] = lambda: 0) -> None:
        self.log, self.step = log, step
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            message = f"{name} again: stopped at once at step {self.step()}, without a new checkpoint"
            self.log(message)
            raise TrainingInterrupted(signum, self.step(), None, message)
        self.requested = signum
        self.log(f"{name} received: finishing step {self.step() + 1}, then saving a checkpoint and stopping "
                 f"({name} again stops at once)")

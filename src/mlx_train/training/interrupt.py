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
    """Records the first SIGTERM/SIGINT (``requested``: its number, or None); a second one to this process
    raises ``TrainingInterrupted`` immediately.

    In a group the ranks agree after each step (``vote``: ``vote(requested) -> any rank asked``, or None for
    one process, where the local request decides): ``stopping`` is then the decision of the last vote.
    ``received`` is the signal that reached this process (None on a rank that stops by the vote alone).
    """

    def __init__(self, log: Callable[[str], None] = print, step: Callable[[], int] = lambda: 0,
                 vote: Callable[[bool], bool | None] = lambda requested: None) -> None:
        self.log, self.step, self._vote = log, step, vote
        self.requested: int | None = None
        self.received: int | None = None
        self.voted: bool | None = None  # the ranks' last vote (None: no vote)
        self._previous: dict[int, Any] = {}

    def vote(self) -> None:
        """After each step, on every rank: a rank that did not get the signal stops as if it had."""
        voted = self.voted = self._vote(self.requested is not None)
        if voted and self.requested is None:
            self.requested = signal.SIGTERM

    @property
    def stopping(self) -> bool:
        """Stop after this step: the last vote in a group, the local request alone."""
        return self.voted if self.voted is not None else self.requested is not None

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
        if self.received is not None:  # a second signal to this process (a stop the vote asked for is no first one)
            message = f"{name} again: stopped at once at step {self.step()}, without a new checkpoint"
            self.log(message)
            raise TrainingInterrupted(signum, self.step(), None, message)
        self.requested = self.received = signum
        self.log(f"{name} received: finishing step {self.step() + 1}, then saving a checkpoint and stopping "
                 f"({name} again stops at once)")

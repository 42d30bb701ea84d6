"""Non-finite steps, found without making the host wait for every step.

A step that produced a NaN/Inf loss or gradient leaves a mark in the running sums it returns: a guarded
step (``nonfinite="skip"``, float16) counts such steps in ``running["nonfinite"]`` (and undoes their
update inside the compiled step); an unguarded one lets ``loss_sum`` turn NaN, which then stays NaN for
the rest of the epoch. ``FiniteWatch`` keeps a reference to that mark after every step (no computation,
no read) and reads them all at once when the loop looks (a report, a validation, a checkpoint, an
epoch's end, the end of the run): the steps whose mark changed are the non-finite ones, named exactly.

Example::

    watch = FiniteWatch()
    watch.start(state.running, state.step)
    for batch in loader:
        state.advance(step(state, batch), n)
        watch.add(state.running)                         # a list append
    bad_steps = watch.take(state.running, state.step)    # one host read: e.g. [5]
"""

from __future__ import annotations

import math
from typing import Any, cast

import mlx.core as mx


class FiniteWatch:
    """The non-finite marks of the steps since the last look (see the module docstring)."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.marks: list[mx.array] = []
        self.first = 0  # the step after which marks[0] was taken

    def start(self, running: dict[str, Any], step: int) -> None:
        """Watch the steps after ``step``, whose running sums are ``running`` now."""
        self.key = "nonfinite" if "nonfinite" in running else "loss_sum" if "loss_sum" in running else None
        self.marks = [running[self.key]] if self.key is not None else []
        self.first = step

    def add(self, running: dict[str, Any]) -> None:
        """One more step ran and returned ``running`` (the hot path: a reference is kept, nothing is read)."""
        if self.key is not None:
            self.marks.append(running[self.key])

    @property
    def pending(self) -> int:
        """Steps added since the last look."""
        return max(len(self.marks) - 1, 0)

    def take(self, running: dict[str, Any], step: int) -> list[int]:
        """The steps since the last look whose loss or gradient was NaN/Inf (one host read), in order;
        watching goes on from ``step``."""
        marks, key, first = self.marks, self.key, self.first
        self.start(running, step)
        if len(marks) < 2:
            return []
        # The common case costs one or two scalar reads: a count that did not grow, a sum still finite (a sum
        # that turns NaN/Inf never turns finite again). Only then are all the marks read.
        last = cast(float, marks[-1].item())
        if (last == marks[0].item()) if key == "nonfinite" else math.isfinite(last):
            return []
        values = cast("list[float]", mx.stack(marks).tolist())  # a list of floats: scalars stacked
        if key == "nonfinite":  # a count of the undone steps
            return [first + i for i in range(1, len(values)) if values[i] > values[i - 1]]
        return [first + i for i in range(1, len(values))  # the first step of a sum that is no longer finite
                if not math.isfinite(values[i]) and math.isfinite(values[i - 1])]

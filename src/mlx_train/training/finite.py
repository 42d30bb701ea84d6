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



class NonFiniteSteps:
    """A run's non-finite steps: marked after every step (``watch``), acted on at each look (``look``).

    The loop looks before every report, validation, checkpoint and epoch end, and when the run ends:
    ``nonfinite="raise"`` and ``"stop"`` act there, up to one report/checkpoint interval after the step,
    and name the step; nothing after it is ever saved or kept as best (``poisoned``). ``"skip"``: the
    step's update was already undone inside it; the look only says so.
    """

    def __init__(self, log: Any) -> None:
        self.watch, self.log = FiniteWatch(), log
        self.poisoned = False  # an update with a NaN/Inf was applied: this state must never be saved
        self.epoch_start = (0, 0)  # (step, loader position) where the current epoch's steps began here

    def begin_epoch(self, running: dict[str, Any], step: int, position: int) -> None:
        self.watch.start(running, step)
        self.epoch_start = (step, position)

    def look(self, state: Any, batches: Any, policy: str) -> bool:
        """Act on the steps flagged since the last look (one host read); True when the run must stop here."""
        bad = self.watch.take(state.running, state.step)
        if not bad:
            return False
        self.poisoned = self.poisoned or policy != "skip"
        return act_on_nonfinite(bad, state, batches, self.epoch_start, policy, self.log)


def act_on_nonfinite(bad: list[int], state: Any, batches: Any, epoch_start: tuple[int, int], policy: str,
                     log: Any) -> bool:
    """Act on the non-finite steps ``bad`` found by a look: ``nonfinite="skip"`` says so (the updates were
    undone inside the steps) and returns False; ``"stop"`` requests a stop, says why and returns True;
    ``"raise"`` raises ``NonFiniteError``. ``epoch_start``: (step, loader position) where the current
    epoch's steps began, to name the batch."""
    from mlx_train.errors import NonFiniteError

    culprits = _replayed(batches, bad, state.epoch, epoch_start)
    if policy == "skip":
        for step in bad:
            log(f"non-finite loss or gradient at {_where(batches, step, state.epoch, epoch_start)}"
                f"{culprits.get(step, '')}: the update was skipped (nonfinite='skip')")
        return False
    step = bad[0]
    where, culprit = _where(batches, step, state.epoch, epoch_start), culprits.get(step, "")
    later = f", found at step {state.step}" if state.step != step else ""
    advice = ("resume from the last checkpoint; find the bad samples, lower learning_rate, set max_grad_norm, "
              "or set nonfinite='skip' to skip such steps")
    if policy == "stop":
        state.request_stop()
        log(f"non-finite loss or gradient at {where}{culprit}; stopping{later} (nonfinite='stop'). The "
            f"model's weights are not finite; the last finite checkpoint is kept. To continue: {advice}")
        return True
    raise NonFiniteError(f"non-finite loss or gradient at {where}{culprit}{later}. The model's weights are no "
                         f"longer finite and nothing was saved after this step. To fix: {advice}")


def _where(batches: Any, step: int, epoch: int, epoch_start: tuple[int, int]) -> str:
    """"step 5 (epoch 1, batch 5 of 8)" for a step of the current epoch."""
    first_step, first_position = epoch_start
    length = batches.length
    place = "" if length is None else f", batch {first_position + step - first_step} of {length}"
    return f"step {step} (epoch {epoch + 1}{place})"


def _replayed(batches: Any, steps: list[int], epoch: int, epoch_start: tuple[int, int]) -> dict[int, str]:
    """Which samples of the given steps' batches hold NaN/Inf (only on this error path): a DataLoader's
    batches are read again from the start of the epoch (a copy of it: the loader is not moved)."""
    from mlx_train.training.schedule import nonfinite_inputs

    first_step, first_position = epoch_start
    wanted = {first_position + step - first_step - 1: step for step in steps}
    found: dict[int, str] = {}
    try:
        replay = batches.replay(epoch)
        for index, batch in enumerate(replay or ()):
            if index in wanted:
                found[wanted[index]] = nonfinite_inputs(batch)
            if index >= max(wanted):
                break
    except Exception:  # noqa: BLE001  # a detail of the message: never in the way of the error it explains
        pass
    return found

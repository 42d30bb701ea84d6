"""``StepExtension``: the protocol of callbacks that run inside the compiled training step.

A callback that is a ``StepExtension`` (``EMA``, ``Pruning``) takes part in every optimizer
update. The Trainer picks them out of its callbacks with ``isinstance(cb, StepExtension)`` and
hands them to ``build_step``; the step then

* adds ``step_state`` to the state the compiled step captures (inputs and outputs of
  ``mx.compile``), once, when the step is built: keep the same container for the whole run and
  fill it in place (``clear()``/``update()``), never assign a new one;
* calls ``in_step(model, optimizer)`` inside the compiled update, right after the optimizer
  applied the gradients (also on a guarded step whose update was undone), in the order of the
  callbacks. It may replace parameters through their modules (``module[key] = ...``), entries
  of ``optimizer.state`` and the arrays of ``step_state``; it must not read Python values of
  arrays (no ``.item()``, no ``np.array``): it is traced once and replayed.

Everything else (masks chosen on a schedule, restored state) happens in the ordinary callback
events, outside the compiled step.

Example::

    class Clamp(Callback):
        step_state: dict = {}

        def in_step(self, model, optimizer):
            model.update(tree_map(lambda w: mx.clip(w, -1, 1), model.trainable_parameters()))

    isinstance(Clamp(), StepExtension)     # True: the Trainer runs it in every update
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import mlx.nn as nn


@runtime_checkable
class StepExtension(Protocol):
    """A callback that runs inside the compiled update: ``step_state`` and ``in_step``.

    ``step_state``: a tree of arrays (dicts of ``mx.array``) captured by the compiled step, filled
    in place. ``in_step(model, optimizer)``: called after every optimizer update, traced.

    Example::

        extensions = [c for c in callbacks if isinstance(c, StepExtension)]
        step = build_step(model, optimizer, loss, options, loss_scale, extensions=extensions)
    """

    step_state: Any

    def in_step(self, model: nn.Module, optimizer: Any) -> None:
        """Inside the compiled update, after the optimizer: change weights, optimizer state or ``step_state``."""
        ...

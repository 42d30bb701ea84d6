"""Tools for testing training code: faults injected into real training steps.

``SimulatedOutOfMemory`` makes chosen steps fail the way MLX's allocator fails, so that a test (yours
or the package's) can check what the Trainer does then: the memory guard undoes the step and retries
it with half the micro-batch, a distributed run's ranks agree, a checkpoint records the decision. It
watches the step through the step's declared seam (``StepObserver``, registered with
``MemoryGuard.observe``): nothing in the library is replaced.

Nothing in the library imports this module.

Example::

    from mlx_train.testing import SimulatedOutOfMemory

    simulated = SimulatedOutOfMemory(steps=[3])
    trainer.train(data, callbacks=[simulated])          # step 3 runs out of memory, then retries with half
    assert simulated.failures == [3]
    assert trainer.memory_guard.events[0]["step"] == 3
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_train.training.oom import CPU_MESSAGE, CUDA_MESSAGE, METAL_MESSAGE
from mlx_train.training.step import StepObserver, TrainStep

__all__ = ["CPU_MESSAGE", "CUDA_MESSAGE", "METAL_MESSAGE", "SimulatedOutOfMemory"]


class SimulatedOutOfMemory(StepObserver):
    """A callback that makes chosen steps fail with MLX's out-of-memory error, to test recovery.

    It has no state for checkpoints (a run resumed without it continues as if it had never been there).

    The error is raised inside the step, after its ``micro_batch``-th micro-batch was dispatched
    (default -1: the last one, whose compiled update is then already in flight), on the first
    ``times`` attempts of each step in ``steps``. With ``evaluated=True`` that micro-batch is
    evaluated first: the update (and, distributed, the gradient exchange) has then happened, as
    when an allocation fails at the very end of a step. ``failures`` lists the step of every failure
    raised.

    Example::

        trainer.train(data, callbacks=[SimulatedOutOfMemory(steps=[3])])   # step 3 retries with half
    """

    def __init__(self, steps: Sequence[int], message: str = METAL_MESSAGE, times: int = 1,
                 micro_batch: int = -1, evaluated: bool = False) -> None:
        self.steps, self.message, self.times, self.micro_batch = set(steps), message, times, micro_batch
        self.evaluated = evaluated
        self.failures: list[int] = []
        self._trainer: Any = None
        self._index = 0  # the micro-batch of the step being run

    def on_fit_start(self, trainer: Any) -> None:
        self._trainer = trainer
        trainer.memory_guard.observe(self)

    def before_micro_batch(self, step: TrainStep, batch: Any, update: bool, weighted: bool) -> None:
        """Nothing: the failure comes once the micro-batch was dispatched."""

    def after_micro_batch(self, step: TrainStep, batch: Any, result: tuple[Any, dict[str, Any]], update: bool,
                          weighted: bool) -> None:
        """Raise MLX's allocation error when this is the chosen micro-batch of a chosen step."""
        index, self._index = self._index, 0 if update else self._index + 1
        number = self._trainer.step + 1
        chosen = update if self.micro_batch == -1 else index == self.micro_batch
        if chosen and number in self.steps and self.failures.count(number) < self.times:
            if self.evaluated:
                step.evaluate(*result, update)  # as the step evaluates it (distributed: the all-reduce first)
            self.failures.append(number)
            self._index = 0
            raise RuntimeError(self.message)

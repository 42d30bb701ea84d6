"""The step a run trains with: ``build_step`` from the config, inside the memory guard.

``StepMaker`` turns the config's step settings (precision, clipping, loss scaling, compilation, the
non-finite policy, gradient checkpointing) and the topology's gradient reduction into the guard's
``build(accumulation, checkpointing)``, and keeps the guard while nothing it was built from changed
(no new compile between two ``train()`` calls).

Example::

    maker = StepMaker(model, optimizer, loss, topology, device_config, log)
    guard = maker.guard(config, state, extensions)
    state.advance(guard(state, batch), n)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_train.config import TrainConfig
from mlx_train.errors import ConfigError, MLXTrainError
from mlx_train.training.oom import MemoryGuard, MemoryPolicy
from mlx_train.training.step import StepOptions, TrainStep, build_step


class StepMaker:
    """Builds (and keeps) the memory guard around the run's step function."""

    def __init__(self, model: Any, optimizer: Any, loss: Any, topology: Any, device_config: Any,
                 log: Callable[[str], None]) -> None:
        self.model, self.optimizer, self.loss, self.topology = model, optimizer, loss, topology
        self.device_config, self.log = device_config, log
        self.recomputed: str | None = None  # what gradient checkpointing recomputes now
        self.current: MemoryGuard | None = None

    def guard(self, config: TrainConfig, state: Any, extensions: tuple[Any, ...]) -> MemoryGuard:
        """The memory guard around the step function, with the micro-batch settings of the loop state."""
        previous = self.current
        settings = state.micro_batch or (previous.settings() if previous is not None else {})
        if previous is not None and previous.extensions == extensions and settings == previous.settings():
            self.topology.watch_step(previous)
            return previous  # the same step: no new compile
        budget = config.memory_limit or getattr(self.device_config, "memory_limit", None)
        policy = MemoryPolicy(recover=config.oom_recovery, budget=budget, device_memory=self._device_memory(),
                              can_checkpoint=self._can_checkpoint(config))
        options: dict[str, Any] = dict(
            precision=config.precision, max_grad_norm=config.max_grad_norm, compile=config.compile,
            loss_scale_window=config.loss_scale_window, nonfinite=config.nonfinite)

        def build(accumulation: int, checkpointing: bool) -> TrainStep:
            # what is recomputed: "blocks" (true, or the memory guard's retry), "attention", "auto", or nothing
            granularity = "blocks" if checkpointing or config.gradient_checkpointing is True else \
                config.gradient_checkpointing or None
            if granularity and self.recomputed not in (granularity, "blocks"):
                from mlx_train.training.recompute import enable_gradient_checkpointing

                enable_gradient_checkpointing(self.model, config.checkpoint_modules, str(granularity))  # before tracing
                self.recomputed = str(granularity)
            return build_step(self.model, self.optimizer, self.loss, StepOptions(accumulation=accumulation, **options),
                              state.loss_scale, self.topology.reduction, extensions)

        guard = self.current = MemoryGuard(build, config.gradient_accumulation, policy, self.topology.group,
                                           self.log, settings)
        guard.extensions = extensions
        self.topology.watch_step(guard)
        return guard

    def _device_memory(self) -> int | None:
        from mlx_train.device import DeviceConfig

        config = self.device_config if isinstance(self.device_config, DeviceConfig) else DeviceConfig()
        try:
            return config.device_memory()
        except MLXTrainError:
            return None

    def _can_checkpoint(self, config: TrainConfig) -> bool:
        from mlx_train.training.recompute import find_blocks

        try:
            find_blocks(self.model, config.checkpoint_modules)
        except ConfigError:
            return False
        return True

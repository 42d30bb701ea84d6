"""Measure the memory model of a real model: a few real training steps at growing micro-batches.

The steps run on the model with a fresh copy of the optimizer, compiled the way the Trainer
compiles them; the model's weights and the random state are put back afterwards, so the model,
the optimizer and the random stream are left as they were.
For each micro-batch (1, 2, 4, ...) the peak comes from MLX's own counter
(``mx.get_peak_memory``); the batch keeps doubling until the growth per sample is steady, then
a line is fitted through the last points. The update peak (weights and optimizer state existing
twice while the update runs) is what the small batches show above that line.

Example::

    from mlx_train.memory import MemoryOptimizer
    profile = MemoryOptimizer.measure(model, data["train"], optimizer="adamw")
    profile.estimate(batch_size=256).total     # bytes
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_train.errors import ConfigError
from mlx_train.memory.model import Curve, MemoryModel
from mlx_train.training.state import rng_key, set_rng_key

__all__ = ["measure", "Measurement", "measure_step", "take_samples", "fit_budget"]


@dataclass(frozen=True)
class Measurement:
    """One measured configuration: the peak bytes of a step (model state included) and its time."""

    batch_size: int
    checkpointing: bool
    peak: int
    seconds: float


def _nbytes(tree: Any) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree) if isinstance(v, mx.array))


def take_samples(batch: Any, size: int) -> Any:
    """The first ``size`` samples of ``batch``, repeating it when it has fewer."""
    def cut(array: mx.array) -> mx.array:
        have = array.shape[0]
        if have < size:
            array = mx.concatenate([array] * -(-size // have), axis=0)
        return array[:size]

    if isinstance(batch, dict):
        return {k: cut(v) for k, v in batch.items()}
    return type(batch)(cut(v) for v in batch) if isinstance(batch, tuple) else [cut(v) for v in batch]


def _first_batch(sample: Any, size: int) -> Any:
    """A batch of up to ``size`` samples from a dataset, a DataLoader or a batch of arrays."""
    from mlx_train.data import DataLoader

    if isinstance(sample, DataLoader):
        loader = sample.replace(batch_size=size, shuffle=False, num_workers=0, drop_last=False)
    else:
        loader = DataLoader(sample, batch_size=size, shuffle=False, num_workers=0, drop_last=False)
    for batch in loader:
        return batch
    raise ConfigError("the sample to measure memory on is empty; pass a dataset or a batch with samples")


def _fresh_optimizer(optimizer: Any) -> Any:
    """A new optimizer like ``optimizer`` (a name or an instance), with its own empty state."""
    if isinstance(optimizer, str):
        from mlx_train.config import TrainConfig
        from mlx_train.optim import build_optimizer

        return build_optimizer(TrainConfig(optimizer=optimizer))
    try:
        clone = copy.deepcopy(optimizer)
    except TypeError:  # holds something that cannot be copied: share it, but not the state
        clone = copy.copy(optimizer)
    clone.state = {k: v for k, v in optimizer.state.items() if isinstance(v, mx.array)}  # step, learning rate
    return clone


class _Runner:
    """Real compiled training steps on the model itself, measured one micro-batch at a time.

    The optimizer is a fresh copy; ``close()`` puts the model's weights back (and undoes the
    gradient checkpointing it turned on), so the caller's model ends as it was.
    """

    def __init__(self, model: nn.Module, optimizer: Any, loss_fn: Callable[..., Any] | None, precision: str) -> None:
        from mlx_train.training.losses import Loss

        self.model = model
        self._weights = tree_flatten(model.parameters())
        self._recomputed: list[Any] = []  # the transform stacks the measurements turned on, undone by close()
        self.optimizer = _fresh_optimizer(optimizer)
        self.optimizer.init(model.trainable_parameters())
        self.loss, self.precision = Loss(loss_fn), precision
        mx.eval(self.optimizer.state)
        self.parameter_bytes = _nbytes(model.parameters())
        self.optimizer_bytes = _nbytes(self.optimizer.state)
        self._build()

    def _build(self) -> None:
        from mlx_train.training.state import LoopState
        from mlx_train.training.step import StepOptions, build_step

        self.loop = LoopState()
        self.steps = build_step(self.model, self.optimizer, self.loss, StepOptions(precision=self.precision),
                                self.loop.loss_scale)

    def checkpointing(self, modules: Sequence[str] | None) -> None:
        from mlx_train.training.recompute import checkpoint

        self._recomputed.append(checkpoint(self.model, modules))
        self._build()  # a new trace: the compiled steps do not see the change otherwise

    def close(self) -> None:
        from mlx.utils import tree_unflatten

        self.model.update(tree_unflatten(self._weights))
        while self._recomputed:
            self._recomputed.pop().undo()

    def measure(self, batch: Any, steps: int = 2) -> tuple[int, float]:
        """(peak bytes of one step, counting the weights, optimizer state and batch; seconds per step)."""
        mx.eval(batch)
        self.loop.running = self.steps.zero_running()
        self.loop.running = self.steps(self.loop, batch)  # compiles for this shape
        gc.collect()
        mx.clear_cache()
        # Everything alive now (the caller's arrays, the saved weights) is left out, then the step's
        # own state is added back: what a training run at this micro-batch holds.
        baseline = mx.get_active_memory()
        held = _nbytes(self.model.parameters()) + _nbytes(self.optimizer.state) + _nbytes(batch)
        peaks, times = [], []
        for _ in range(steps):
            mx.reset_peak_memory()
            start = time.perf_counter()
            self.loop.running = self.steps(self.loop, batch)
            times.append(time.perf_counter() - start)
            peaks.append(mx.get_peak_memory())
        return max(peaks) - baseline + held, min(times)

    def first_peak(self, batch: Any) -> int:
        """Peak bytes of the first step of this batch's shape (its compilation included), counting the
        weights, optimizer state and batch: unlike later steps, the same number in every identical run."""
        mx.eval(batch)
        self.loop.running = self.steps.zero_running()
        gc.collect()
        mx.clear_cache()
        baseline = mx.get_active_memory()
        held = _nbytes(self.model.parameters()) + _nbytes(self.optimizer.state) + _nbytes(batch)
        mx.reset_peak_memory()
        self.loop.running = self.steps(self.loop, batch)
        return int(mx.get_peak_memory() - baseline + held)


def measure_step(model: nn.Module, batch: Any, *, optimizer: Any = "adamw", loss_fn: Callable[..., Any] | None = None,
                 precision: str = "float32", checkpoint_modules: Sequence[str] | None = None,
                 gradient_checkpointing: bool = False) -> Measurement:
    """Peak memory (model state included) and time of a real training step on ``batch``.

    Example::

        measure_step(model, (x[:64], y[:64]), gradient_checkpointing=True).peak
    """
    from mlx_train.training.losses import batch_size_of

    key = rng_key()
    runner = _Runner(model, optimizer, loss_fn, precision)
    try:
        if gradient_checkpointing:
            runner.checkpointing(checkpoint_modules)
        peak, seconds = runner.measure(batch)
    finally:
        runner.close()
        set_rng_key(key)

    return Measurement(batch_size_of(batch), gradient_checkpointing, int(peak), seconds)


def fit_budget(model: nn.Module, batch: Any, budget: float, *, optimizer: Any,
               loss_fn: Callable[..., Any] | None = None, precision: str = "float32",
               accumulation: int = 1) -> tuple[int, MemoryModel]:
    """The largest micro-batch of ``batch`` whose step is expected to peak within ``budget`` bytes, and
    the memory model that says so.

    Real first steps at micro-batches 1, 2, 4, ... measure the model (as ``measure`` does, the model,
    optimizer and random state are left as they were); the doubling stops before a micro-batch the
    points so far say would not fit, so no measured step goes far over the budget. No clock decides
    anything: identical runs plan the same. 0 means not even one sample fits.

    Example::

        largest, profile = fit_budget(model, (x[:256], y[:256]), 2e9, optimizer=optimizer, accumulation=2)
    """
    from mlx_train.training.losses import batch_size_of

    full, key = batch_size_of(batch), rng_key()
    runner = _Runner(model, optimizer, loss_fn, precision)
    points: list[tuple[int, float]] = []
    try:
        size = 1
        while True:
            points.append((size, runner.first_peak(take_samples(batch, size))))
            following = min(2 * size, full)
            if following == size or _steady(points):
                break
            slope = (points[-1][1] - points[-2][1]) / (points[-1][0] - points[-2][0]) if len(points) > 1 else 0.0
            if points[-1][1] + 2 * max(slope, 0.0) * (following - size) > budget:
                break  # twice the growth seen so far: the growth per sample may still be rising
            size = following
    finally:
        runner.close()
        set_rng_key(key)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    profile = MemoryModel(params, precision, type(runner.optimizer).__name__.lower(), runner.optimizer_bytes,
                          {False: _fit(points)}, "measured", f"{type(model).__name__}, first steps at "
                          f"micro-batches 1 to {size}", parameter_bytes=runner.parameter_bytes,
                          trainable_count=trainable, input_bytes=_nbytes(batch) / max(1, full))
    del runner
    gc.collect()
    mx.clear_cache()
    return min(full, profile.max_batch_size(budget, accumulation)), profile


def _fit(points: list[tuple[int, float]]) -> Curve:
    """A line through the last (up to three) points; the update peak from the points above it."""
    fitted = points[-3:]
    if len(fitted) == 1:
        slope = 0.0
    else:
        mean_b = sum(b for b, _ in fitted) / len(fitted)
        mean_p = sum(p for _, p in fitted) / len(fitted)
        slope = sum((b - mean_b) * (p - mean_p) for b, p in fitted) / sum((b - mean_b) ** 2 for b, _ in fitted)
        slope = max(slope, 0.0)
    intercept = max(p - slope * b for b, p in fitted)  # the line through the highest point: no underestimate
    early = [p for b, p in points[:-3] if p > intercept + slope * b]
    return Curve(fixed=intercept, per_sample=slope, update=max(early, default=0.0))


def _steady(points: list[tuple[int, float]]) -> bool:
    """True once the per-sample growth of the last three doublings agrees (within 10%) and shows."""
    if len(points) < 4 or points[-1][0] < 16:
        return False
    last = points[-4:]
    slopes = [(p1 - p0) / (b1 - b0) for (b0, p0), (b1, p1) in zip(last, last[1:], strict=False)]
    return slopes[-1] > 0 and all(abs(s - slopes[-1]) <= 0.1 * slopes[-1] for s in slopes) \
        and last[-1][1] >= 1.5 * points[0][1]


def measure(model: nn.Module, sample: Any, *, optimizer: Any = "adamw", loss_fn: Callable[..., Any] | None = None,
            precision: str = "float32", checkpoint_modules: Sequence[str] | None = None,
            max_batch_size: int = 64, max_seconds: float = 30.0) -> MemoryModel:
    """Measure the memory model of ``model`` on samples of ``sample`` (a dataset, DataLoader or batch).

    ``optimizer`` is a name (``"adamw"``) or an optimizer (copied, never stepped). Measures with
    and without gradient checkpointing when the model has blocks to recompute (``model.layers``
    or ``checkpoint_modules``). Stops doubling the micro-batch at ``max_batch_size`` or after
    ``max_seconds`` per mode.

    Example::

        profile = measure(model, data["train"], optimizer="adamw", precision="float32")
    """
    if max_batch_size < 1:
        raise ConfigError(f"max_batch_size must be at least 1, got {max_batch_size}")
    source = _first_batch(sample, max_batch_size)
    key = rng_key()  # dropout in the measured steps must not move the caller's random stream
    try:
        return _measure(model, source, optimizer, loss_fn, precision, checkpoint_modules, max_batch_size,
                        max_seconds)
    finally:
        set_rng_key(key)
        gc.collect()
        mx.clear_cache()


def _measure(model: nn.Module, source: Any, optimizer: Any, loss_fn: Callable[..., Any] | None, precision: str,
             checkpoint_modules: Sequence[str] | None, max_batch_size: int, max_seconds: float) -> MemoryModel:
    from mlx_train.training.recompute import find_blocks

    try:
        find_blocks(model, checkpoint_modules)
        modes = [False, True]
    except ConfigError:
        modes = [False]
    curves: dict[bool, Curve] = {}
    measured: list[Measurement] = []
    sizes: list[int] = []
    for checkpointing in modes:
        runner = _Runner(model, optimizer, loss_fn, precision)
        points: list[tuple[int, float]] = []
        try:
            if checkpointing:
                runner.checkpointing(checkpoint_modules)
            start, size = time.perf_counter(), 1
            while True:
                peak, seconds = runner.measure(take_samples(source, size))
                points.append((size, peak))
                measured.append(Measurement(size, checkpointing, int(peak), seconds))
                if _steady(points) or size >= max_batch_size or time.perf_counter() - start > max_seconds:
                    break
                size = min(2 * size, max_batch_size)
        finally:
            runner.close()
        curves[checkpointing] = _fit(points)
        sizes.append(size)
        parameter_bytes, optimizer_bytes = runner.parameter_bytes, runner.optimizer_bytes
        del runner
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    name = optimizer if isinstance(optimizer, str) else type(optimizer).__name__.lower()
    description = f"{type(model).__name__}, measured at micro-batches 1 to {max(sizes)}"
    per_sample = _nbytes(source) / max(1, _batch_size(source))
    return MemoryModel(params, precision, name, optimizer_bytes, curves, "measured", description,
                       _sequence_length(source), (), parameter_bytes=parameter_bytes,
                       trainable_count=trainable, input_bytes=per_sample, measurements=tuple(measured))


def _batch_size(batch: Any) -> int:
    from mlx_train.training.losses import batch_size_of

    return batch_size_of(batch)


def _sequence_length(batch: Any) -> int | None:
    """Tokens per sample of a batch of token ids (``{"tokens": [B, T + 1]}`` feeds ``T``); else None."""
    from mlx_train.training.losses import split_parts

    inputs = split_parts(batch).inputs
    if isinstance(inputs, mx.array) and inputs.ndim == 2 and mx.issubdtype(inputs.dtype, mx.integer):
        return int(inputs.shape[1])
    return None

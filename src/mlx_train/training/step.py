"""The training step: one builder, one step function.

``build_step`` returns a ``TrainStep``; the loop's transition is ``state.advance(step(state, batch), n)``.
A step takes one step batch, splits it into ``accumulation`` micro-batches and runs each through
a function compiled once with the model, optimizer and RNG state captured
(``mx.compile(fn, inputs=state, outputs=state)``); the last micro-batch applies the update.
Gradients are weighted by the number of items each micro-batch averages over, so
``batch 8 x accumulation 4`` equals ``batch 32``. Distributed training passes its gradient
reduction in (``Reduction``); extensions (pruning masks, weight averages) run inside the compiled
update after the optimizer. Whoever needs to see each micro-batch (counting collectives, injecting
faults: ``mlx_train.testing``) registers a ``StepObserver`` with ``step.observe(observer)``.

Example::

    step = build_step(model, optimizer, Loss(), StepOptions(accumulation=4), state.loss_scale)
    state.begin_epoch(0, step.zero_running())
    state.advance(step(state, batch), 32)       # one optimizer step, one mx.eval per micro-batch
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from mlx_train.distributed import collectives
from mlx_train.distributed.reduction import Reduction
from mlx_train.errors import DataError
from mlx_train.training.extensions import StepExtension
from mlx_train.training.losses import METRIC_PREFIX, WINDOW_PREFIX, Loss, add_metrics, count_correct
from mlx_train.training.state import assign_leaves, zero

__all__ = ["ANOTHER_RANK", "AnotherRankOutOfMemory", "Reduction", "StepObserver", "StepOptions", "TrainStep",
           "average_gradients", "build_eval_step", "build_step", "describe_shapes", "split_batch"]

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(frozen=True)
class StepOptions:
    """How a step computes: precision, micro-batches per step, clipping, float16 loss scaling, compilation."""

    precision: str = "float32"
    accumulation: int = 1
    max_grad_norm: float | None = None
    loss_scale_window: int = 1000
    compile: bool = True
    nonfinite: str = "raise"  # a NaN/Inf loss or gradient: "raise"/"stop" (flagged), "skip" (update undone)


class StepObserver(Protocol):
    """Sees every micro-batch a ``TrainStep`` runs; registered with ``step.observe(observer)``.

    Both methods run in Python around the dispatch of one micro-batch (nothing is evaluated for them).
    ``update`` is True for the step's last micro-batch, which applies the optimizer update;
    ``weighted`` says whether the gradient is weighted by the micro-batch's item count. An exception
    raised by either method leaves the step as an exception of its micro-batch would (the memory guard
    undoes the step, and retries it when the error is an allocation failure).

    Example::

        class CountMicroBatches:
            def __init__(self) -> None:
                self.seen = 0

            def before_micro_batch(self, step, batch, update, weighted) -> None:
                self.seen += 1

            def after_micro_batch(self, step, batch, result, update, weighted) -> None:
                pass

        step.observe(CountMicroBatches())
    """

    def before_micro_batch(self, step: TrainStep, batch: Any, update: bool, weighted: bool) -> None:
        """Called before the micro-batch is dispatched."""

    def after_micro_batch(self, step: TrainStep, batch: Any, result: tuple[Any, dict[str, Any]], update: bool,
                          weighted: bool) -> None:
        """Called after it was dispatched, with its result ``(gradient sum, running sums)``, not evaluated."""


#: What a step raises when its all-reduce carried another rank's out-of-memory vote.
ANOTHER_RANK = "another rank ran out of memory"


class AnotherRankOutOfMemory(RuntimeError):
    """Another rank's step ran out of memory before the all-reduce (its vote said so): this rank's update
    was not applied. An out-of-memory error (``is_out_of_memory``) like the other rank's own."""


def average_gradients(group: Any) -> Reduction:
    """Data-parallel reduction: gradients and item counts averaged over ``group`` (MLX's all-reduce)."""
    world = group.size()

    def reduce(grads: Any, n_items: mx.array | None) -> tuple[Any, mx.array | None]:
        grads = nn.average_gradients(grads, group=group)
        if n_items is not None:
            n_items = collectives.all_sum(n_items, group=group) / world
        return grads, n_items

    return Reduction(reduce)


def _all_finite(tree: Any) -> mx.array:
    leaves = [mx.isfinite(g).all() for _, g in tree_flatten(tree)]
    return mx.stack(leaves).all() if leaves else mx.array(True)


def _add_sums(running: dict[str, Any], loss_sum: mx.array, n: mx.array, metrics: dict[str, mx.array],
              keep: mx.array | None = None) -> dict[str, Any]:
    """``running`` with one micro-batch's loss, items and metric sums added to the epoch's and the window's."""
    added = {"loss_sum": loss_sum, "items": n, **add_metrics({}, metrics, n, keep)}
    running = dict(running)  # updated in place: the key order, which the compiled step sees, stays the same
    for prefix in ("", WINDOW_PREFIX):
        for key, value in added.items():  # a metric the loss did not declare (``metric_names``) starts here
            running[prefix + key] = running.get(prefix + key, mx.array(0.0)) + value
    return running


def _model_failed(batch: Any, error: ValueError) -> DataError:
    """The error for a step that failed on ``batch`` (MLX reports shape mismatches as ValueError)."""
    return DataError(f"the model failed on a batch of shapes {describe_shapes(batch)}: {error}. Check that the "
                     "dataset's arrays match what the model expects (feature size, dtype, sequence layout)")


def _cast(params: Any, dtype: mx.Dtype) -> Any:
    return tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, params)


class TrainStep:
    """One optimizer step: ``running = step(state, batch)`` (``state`` needs ``.running``).

    ``state`` (the list) is what the compiled functions capture: model, optimizer, RNG, and the
    float16 loss scale and extension state when used. ``micro`` runs one micro-batch; ``observers``
    (``observe``) see each one.
    """

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, loss: Loss, options: StepOptions,
                 loss_scale: dict[str, mx.array], reduction: Reduction | None = None,
                 extensions: Sequence[StepExtension] = ()) -> None:
        self.model, self.optimizer, self.loss, self.options = model, optimizer, loss, options
        self.compute_dtype = DTYPES[options.precision]
        self.dynamic_scaling = options.precision == "float16"
        self.loss_scale, self.reduction, self.extensions = loss_scale, reduction, list(extensions)
        self.state: list[Any] = [model.state, optimizer.state, mx.random.state]
        if self.dynamic_scaling:  # only when used: fewer inputs per call
            self.state.append(loss_scale)
        self.state += [ext.step_state for ext in self.extensions]
        #: The ranks' votes its all-reduce carries (``Reduction.votes``), or None.
        self.votes = reduction.votes if reduction is not None else None
        if self.votes is not None:
            self.state.append(self.votes.state)
        #: Whether this step's all-reduce has run (with out-of-memory votes: see ``evaluate``).
        self.exchanged = False
        wrap = partial(mx.compile, inputs=self.state, outputs=self.state) if options.compile else (lambda f: f)
        self._compiled = {(update, weighted): wrap(partial(self._micro, update=update, weighted=weighted))
                          for update in (False, True) for weighted in (False, True)}
        # Guarded steps undo a non-finite update (float16 overflow, nonfinite="skip") and count such steps.
        self._guarded = self.dynamic_scaling or options.nonfinite == "skip"
        # One micro-batch on one process: the gradient of the mean is used as is (fewer operations).
        self._single = options.accumulation == 1 and reduction is None
        self._zero: dict[str, mx.array] | None = None  # zero_running(), made once
        self.observers: list[StepObserver] = []
        # One micro-batch on one process, nobody observing: the step calls this compiled function directly.
        self._fast: Callable[..., Any] | None = self._compiled[True, False] if self._single else None

    def zero_running(self) -> dict[str, mx.array]:
        """Fresh on-device sums for an epoch's reported training metrics, and the same sums for the report
        window (``window:<key>``, zeroed at each report); ``nonfinite``, in guarded steps, counts the steps
        whose loss or gradient was NaN/Inf and were undone."""
        if self._zero is None:  # the same keys every epoch: found once
            sums = ["loss_sum", "items", *(METRIC_PREFIX + name for name in self.loss.metric_names)]
            fresh = zero()
            self._zero = {prefix + key: fresh for prefix in ("", WINDOW_PREFIX) for key in sums}
            if self._guarded:
                self._zero["nonfinite"] = fresh
            if self.options.max_grad_norm is not None:
                self._zero["grad_norm"] = fresh
        return dict(self._zero)

    def __call__(self, state: Any, batch: Any) -> dict[str, mx.array]:
        if self._fast is not None:  # one micro-batch, one process: micro's call inlined
            try:
                running = self._fast(batch, None, state.running)[1]
            except DataError:
                raise
            except ValueError as error:
                raise _model_failed(batch, error) from error
            mx.eval(self.state, running)
            return cast("dict[str, mx.array]", running)
        running, grads = state.running, None
        parts = split_batch(batch, self.options.accumulation)
        last = len(parts) - 1
        self.exchanged = False
        for i, part in enumerate(parts):
            if i == last and self.reduction is not None and self.reduction.before_update is not None:
                self.reduction.before_update()
            grads, running = self.micro(part, grads, running, i == last, not self._single)
            self.evaluate(grads, running, i == last)
        return cast("dict[str, mx.array]", running)

    def evaluate(self, grads: Any, running: dict[str, Any], update: bool) -> None:
        """Evaluate a micro-batch's result (``micro``'s). When the all-reduce carries the ranks' out-of-memory
        votes, the update's micro-batch first evaluates the all-reduce (``exchanged`` is then True) and reads
        the votes: if a rank's step failed before it, the update is not evaluated and ``AnotherRankOutOfMemory``
        is raised, on every other rank alike."""
        votes = self.votes
        if update and votes is not None and "out_of_memory" in votes.names:
            mx.eval(votes.state)
            self.exchanged = True
            if votes.summed()["out_of_memory"]:
                raise AnotherRankOutOfMemory(ANOTHER_RANK)
        mx.eval(self.state, grads, running)

    def stand_in(self) -> None:
        """After this rank's step failed before its all-reduce: the all-reduce with zero gradients and this
        rank's out-of-memory vote in their place, so that the other ranks' step completes and raises
        ``AnotherRankOutOfMemory`` (their update is not evaluated)."""
        votes, reduction = self.votes, self.reduction
        if votes is None or reduction is None:
            return
        if reduction.before_update is not None:
            reduction.before_update()
        votes.cast(out_of_memory=True)
        zeros = tree_map(mx.zeros_like, self.model.trainable_parameters())
        mx.eval(reduction.reduce(zeros, mx.array(0.0)), votes.state)
        self.exchanged = True

    def observe(self, observer: StepObserver) -> None:
        """Show every micro-batch to ``observer`` (see ``StepObserver``), the single micro-batch's too."""
        if observer not in self.observers:
            self.observers.append(observer)
        self._fast = None

    def micro(self, batch: Any, grads: Any, running: dict[str, Any], update: bool,
              weighted: bool) -> tuple[Any, dict[str, Any]]:
        """Run one micro-batch; apply the update when ``update``. Returns (gradient sum, running sums)."""
        for observer in self.observers:
            observer.before_micro_batch(self, batch, update, weighted)
        try:
            result = cast("tuple[Any, dict[str, Any]]", self._compiled[update, weighted](batch, grads, running))
        except DataError:
            raise
        except ValueError as error:
            raise _model_failed(batch, error) from error
        for observer in self.observers:
            observer.after_micro_batch(self, batch, result, update, weighted)
        return result

    # -- traced bodies ------------------------------------------------------------------

    def _objective(self, params: Any, batch: Any, weighted: bool) -> tuple[mx.array, tuple[Any, ...]]:
        if self.compute_dtype != mx.float32:
            params = _cast(params, self.compute_dtype)
        self.model.update(params)
        value, n, _, metrics = self.loss(self.model, batch)
        objective = value * n if weighted else value
        if self.dynamic_scaling:
            objective = objective * self.loss_scale["scale"]
        return objective, (value, n, metrics)

    def _micro(self, batch: Any, grad_sum: Any, running: dict[str, Any], update: bool,
               weighted: bool) -> tuple[Any, dict[str, Any]]:
        params = self.model.trainable_parameters()
        (_, (value, n, metrics)), grads = mx.value_and_grad(self._objective)(params, batch, weighted)
        self.model.update(params)  # back to the float32 master weights
        if grad_sum is not None:
            grads = tree_map(mx.add, grad_sum, grads)
            n_total = running["pending_items"] + n
        else:
            n_total = n
        running = dict(running)
        if not self._guarded:
            # Unguarded ("raise"/"stop", float32/bfloat16): a NaN/Inf loss makes loss_sum non-finite, which the
            # loop reads after the step; no extra operation in the step. A gradient that turns non-finite under
            # a finite loss (without clipping) makes the weights non-finite, which the next step's loss shows.
            running = _add_sums(running, value * n, n, metrics)
            if not update:
                running["pending_items"] = n_total
                return grads, running
            running.pop("pending_items", None)
            norm, _ = self._apply(grads, n_total if weighted else None, None)
            if norm is not None:
                running["grad_norm"] = norm
                running["loss_sum"] = mx.where(mx.isfinite(norm), running["loss_sum"], mx.nan)  # flag it too
            return None, running
        finite = mx.isfinite(value)
        if grad_sum is not None:
            finite = finite & running["pending_finite"]
        # A non-finite micro-batch adds nothing to the sums: the reported loss stays readable.
        running = _add_sums(running, mx.where(finite, value * n, 0.0), mx.where(finite, n, 0.0), metrics, finite)
        if not update:
            running["pending_items"], running["pending_finite"] = n_total, finite
            return grads, running
        running.pop("pending_items", None)
        running.pop("pending_finite", None)
        norm, grads_finite = self._apply(grads, n_total if weighted else None, finite)
        # float16 gradients overflow by design while the scale settles: only a non-finite loss is flagged then
        flagged = ~finite if self.dynamic_scaling else ~(finite & grads_finite)
        running["nonfinite"] = running["nonfinite"] + flagged.astype(mx.float32)
        if norm is not None:
            running["grad_norm"] = norm
        return None, running

    def _apply(self, grads: Any, n_total: mx.array | None,
               finite: mx.array | None) -> tuple[mx.array | None, mx.array]:
        """Reduce, scale, clip and apply the gradients; returns (clip norm or None, gradients finite). With
        ``finite`` (guarded steps) a step whose loss or gradients are not finite leaves weights and optimizer
        as they were; unguarded steps do not check the gradients (the second value is then True)."""
        if self.reduction is not None:
            grads, n_total = self.reduction.reduce(grads, n_total)
        scale = self.loss_scale["scale"] if self.dynamic_scaling else None
        if n_total is not None or scale is not None:
            divisor = (n_total if n_total is not None else 1.0) * (scale if scale is not None else 1.0)
            grads = tree_map(lambda g: g / divisor, grads)
        grads, norm = self._clip(grads)
        grads_finite = mx.array(True)
        if finite is None:
            self.optimizer.update(self.model, grads)
        else:
            grads_finite = mx.isfinite(norm) if norm is not None else _all_finite(grads)
            self._update_if_finite(grads, finite & grads_finite)
        for extension in self.extensions:
            extension.in_step(self.model, self.optimizer)
        return norm, grads_finite

    def _clip(self, grads: Any) -> tuple[Any, mx.array | None]:
        if self.reduction is not None and self.reduction.clip is not None:
            return self.reduction.clip(grads, self.options.max_grad_norm)
        if self.options.max_grad_norm is not None:
            return cast("tuple[Any, mx.array]", optim.clip_grad_norm(grads, self.options.max_grad_norm))
        return grads, None  # no norm without clipping: its reductions cost ~15% of a small model's step

    def _update_if_finite(self, grads: Any, finite: mx.array) -> None:
        """A non-finite step keeps the old weights and optimizer state; with float16 the loss scale adapts."""
        old_params = self.model.trainable_parameters()
        old_state = tree_flatten(self.optimizer.state)
        self.optimizer.update(self.model, grads)
        self.model.update(tree_map(lambda new, old: mx.where(finite, new, old),
                                   self.model.trainable_parameters(), old_params))
        new_state = dict(tree_flatten(self.optimizer.state))
        assign_leaves(self.optimizer.state, {k: mx.where(finite, new_state[k], v) for k, v in old_state})
        if not self.dynamic_scaling:
            return
        good = mx.where(finite, self.loss_scale["good_steps"] + 1, 0)
        grow = good >= self.options.loss_scale_window
        scale = self.loss_scale["scale"]
        self.loss_scale["scale"] = mx.where(finite, mx.where(grow, scale * 2.0, scale), mx.maximum(scale * 0.5, 1.0))
        self.loss_scale["good_steps"] = mx.where(grow, 0, good)


def build_step(model: nn.Module, optimizer: optim.Optimizer, loss: Loss, options: StepOptions,
               loss_scale: dict[str, mx.array], reduction: Reduction | None = None,
               extensions: Sequence[StepExtension] = ()) -> TrainStep:
    """The training step for this model, optimizer, loss and options (see the module docstring)."""
    return TrainStep(model, optimizer, loss, options, loss_scale, reduction, extensions)


def build_eval_step(model: nn.Module, loss: Loss, precision: str = "float32",
                    compile: bool = True) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    """``sums = evaluate(batch, sums)``: adds one batch's loss (and accuracy counts when they apply)."""
    dtype = DTYPES[precision]

    def evaluate(batch: Any, sums: dict[str, Any]) -> dict[str, Any]:
        params = model.parameters()
        if dtype != mx.float32:
            model.update(_cast(params, dtype))
        value, n, outputs, metrics = loss(model, batch)
        model.update(params)
        sums = add_metrics(sums, metrics, n)
        sums["loss_sum"] = sums["loss_sum"] + value * n
        sums["items"] = sums["items"] + n
        correct = count_correct(outputs, batch)
        if correct is not None:
            sums["correct"] = sums.get("correct", mx.array(0.0)) + correct[0]
            sums["counted"] = sums.get("counted", mx.array(0.0)) + correct[1]
        return sums

    return mx.compile(evaluate, inputs=[model.state, mx.random.state]) if compile else evaluate


def split_batch(batch: Any, parts: int) -> list[Any]:
    """Split a step batch into ``parts`` micro-batches along the first axis (sizes differ by at most 1)."""
    if parts == 1:
        return [batch]
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    size = first.shape[0]
    bounds = [(size * i) // parts for i in range(parts + 1)]
    slices = [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=False) if b > a]
    if isinstance(batch, dict):
        return [{k: v[a:b] for k, v in batch.items()} for a, b in slices]
    return [type(batch)(v[a:b] for v in batch) if isinstance(batch, tuple) else [v[a:b] for v in batch]
            for a, b in slices]


def describe_shapes(batch: Any) -> str:
    """Shapes of a batch's arrays, for error messages: ``((32, 64), (32,))`` or ``{'tokens': (8, 33)}``."""
    if isinstance(batch, dict):
        return str({k: tuple(v.shape) for k, v in batch.items()})
    return str(tuple(tuple(v.shape) for v in batch))

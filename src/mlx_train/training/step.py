"""The compiled training and evaluation steps.

One function per step kind, compiled once with the model, optimizer and RNG state captured
(``mx.compile(fn, inputs=state, outputs=state)``). Gradient accumulation happens inside the
compiled path: each micro-batch's gradients are added to a running sum that the step carries,
and the last micro-batch of a step applies the update. Gradients are weighted by the number of
items each micro-batch averages over, so ``batch 8 x accumulation 4`` equals ``batch 32``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_train.errors import DataError
from mlx_train.training.losses import Loss, count_correct

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _all_finite(tree: Any) -> mx.array:
    leaves = [mx.isfinite(g).all() for _, g in tree_flatten(tree)]
    return mx.stack(leaves).all() if leaves else mx.array(True)


class Steps:
    """Builds the compiled steps for one model/optimizer/loss/precision combination.

    Example::

        steps = Steps(model, optimizer, Loss(), precision="float32")
        metrics = steps.zero_metrics()
        grads, metrics = steps.micro(batch, None, metrics, update=True)
        mx.eval(steps.state, metrics)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: optim.Optimizer,
        loss: Loss,
        precision: str = "float32",
        max_grad_norm: float | None = None,
        loss_scale: float = 65536.0,
        loss_scale_window: int = 1000,
        compile: bool = True,
        group: Any = None,
    ) -> None:
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.compute_dtype = _DTYPES[precision]
        self.max_grad_norm = max_grad_norm
        self.dynamic_scaling = precision == "float16"
        self.loss_scale_window = loss_scale_window
        self.group = group
        self.world_size = group.size() if group is not None else 1
        self.scaler = {"scale": mx.array(loss_scale if self.dynamic_scaling else 1.0), "good_steps": mx.array(0)}
        # The loss-scale state only joins the compiled state when float16 needs it (fewer inputs per call).
        self.state = [model.state, optimizer.state, mx.random.state] + ([self.scaler] if self.dynamic_scaling else [])
        wrap = partial(mx.compile, inputs=self.state, outputs=self.state) if compile else (lambda f: f)
        self._train = {}
        for update in (False, True):
            for weighted in (False, True):
                self._train[update, weighted] = wrap(partial(self._micro, update=update, weighted=weighted))
        self._eval = (partial(mx.compile, inputs=self.state) if compile else (lambda f: f))(self._eval_step)

    # -- public entry points ------------------------------------------------------------

    def zero_metrics(self) -> dict[str, mx.array]:
        """Fresh on-device accumulators for reported training metrics."""
        metrics = {"loss_sum": mx.array(0.0), "items": mx.array(0.0)}
        if self.max_grad_norm is not None:
            metrics["grad_norm"] = mx.array(0.0)
        return metrics

    def micro(self, batch: Any, grads: Any, metrics: dict, update: bool, single: bool = False):
        """Run one micro-batch; apply the update when ``update``. Returns (grad_sum, metrics).

        ``single`` marks a step made of one micro-batch on one rank: the gradient of the mean is
        used directly instead of the weighted sum (same result, fewer operations).
        """
        fn = self._train[update, not single]
        return fn(batch, grads, metrics)

    def evaluate(self, batch: Any, metrics: dict) -> dict:
        """Accumulate loss (and accuracy when it applies) of one batch into ``metrics``."""
        return self._eval(batch, metrics)

    # -- traced bodies ------------------------------------------------------------------

    def _objective(self, params: Any, batch: Any, weighted: bool):
        if self.compute_dtype != mx.float32:
            params = tree_map(lambda p: p.astype(self.compute_dtype) if mx.issubdtype(p.dtype, mx.floating) else p, params)
        self.model.update(params)
        value, n, _ = self.loss(self.model, batch)
        objective = value * n if weighted else value
        if self.dynamic_scaling:
            objective = objective * self.scaler["scale"]
        return objective, (value, n)

    def _micro(self, batch: Any, grad_sum: Any, metrics: dict, update: bool, weighted: bool):
        params = self.model.trainable_parameters()
        (_, (value, n)), grads = mx.value_and_grad(self._objective)(params, batch, weighted)
        self.model.update(params)  # back to the float32 master weights
        if grad_sum is not None:
            grads = tree_map(mx.add, grad_sum, grads)
            n_total = metrics["pending_items"] + n
        else:
            n_total = n
        metrics = dict(metrics)
        metrics["loss_sum"] = metrics["loss_sum"] + value * n
        metrics["items"] = metrics["items"] + n
        if not update:
            metrics["pending_items"] = n_total
            return grads, metrics
        metrics.pop("pending_items", None)
        norm = self._apply(grads, n_total if weighted else None)
        if norm is not None:
            metrics["grad_norm"] = norm
        return None, metrics

    def _reduce_gradients(self, grads: Any, n_total: mx.array | None) -> tuple[Any, mx.array | None]:
        """Average gradients (and the item counts that weight them) over the ranks; a no-op alone."""
        if self.world_size > 1:
            grads = nn.average_gradients(grads, group=self.group)
            if n_total is not None:
                n_total = mx.distributed.all_sum(n_total, group=self.group) / self.world_size
        return grads, n_total

    def _clip_gradients(self, grads: Any) -> tuple[Any, mx.array | None]:
        """Clip to ``max_grad_norm`` when set; returns (gradients, their global L2 norm, or None)."""
        if self.max_grad_norm is not None:
            return optim.clip_grad_norm(grads, self.max_grad_norm)
        # No norm without clipping: on a small model its reductions cost ~15% of a step.
        return grads, None

    def _apply(self, grads: Any, n_total: mx.array | None) -> mx.array:
        grads, n_total = self._reduce_gradients(grads, n_total)
        scale = self.scaler["scale"] if self.dynamic_scaling else None
        if n_total is not None or scale is not None:
            divisor = (n_total if n_total is not None else 1.0) * (scale if scale is not None else 1.0)
            grads = tree_map(lambda g: g / divisor, grads)
        grads, norm = self._clip_gradients(grads)
        if not self.dynamic_scaling:
            self.optimizer.update(self.model, grads)
            return norm
        finite = _all_finite(grads)
        old_params = self.model.trainable_parameters()
        old_state = tree_flatten(self.optimizer.state)
        self.optimizer.update(self.model, grads)
        # An overflowed step is skipped: keep the old weights and optimizer state.
        self.model.update(tree_map(lambda new, old: mx.where(finite, new, old), self.model.trainable_parameters(), old_params))
        new_state = dict(tree_flatten(self.optimizer.state))
        kept = [(k, mx.where(finite, new_state[k], v)) for k, v in old_state]
        self.optimizer.state.update(tree_unflatten(kept))
        good = mx.where(finite, self.scaler["good_steps"] + 1, 0)
        grow = good >= self.loss_scale_window
        scale = self.scaler["scale"]
        self.scaler["scale"] = mx.where(finite, mx.where(grow, scale * 2.0, scale), mx.maximum(scale * 0.5, 1.0))
        self.scaler["good_steps"] = mx.where(grow, 0, good)
        return norm

    def _eval_step(self, batch: Any, metrics: dict) -> dict:
        params = self.model.parameters()
        if self.compute_dtype != mx.float32:
            self.model.update(tree_map(lambda p: p.astype(self.compute_dtype) if mx.issubdtype(p.dtype, mx.floating) else p, params))
        value, n, outputs = self.loss(self.model, batch)
        self.model.update(params)
        metrics = dict(metrics)
        metrics["loss_sum"] = metrics["loss_sum"] + value * n
        metrics["items"] = metrics["items"] + n
        correct = count_correct(outputs, batch)
        if correct is not None:
            metrics["correct"] = metrics.get("correct", mx.array(0.0)) + correct[0]
            metrics["counted"] = metrics.get("counted", mx.array(0.0)) + correct[1]
        return metrics


def split_batch(batch: Any, parts: int) -> list[Any]:
    """Split a step batch into ``parts`` micro-batches along the first axis (sizes differ by at most 1)."""
    if parts == 1:
        return [batch]
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    size = first.shape[0]
    bounds = [(size * i) // parts for i in range(parts + 1)]
    slices = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if isinstance(batch, dict):
        return [{k: v[a:b] for k, v in batch.items()} for a, b in slices]
    return [type(batch)(v[a:b] for v in batch) if isinstance(batch, tuple) else [v[a:b] for v in batch] for a, b in slices]


def describe_shapes(batch: Any) -> str:
    """Shapes of a batch's arrays, for error messages: ``((32, 64), (32,))`` or ``{'tokens': (8, 33)}``."""
    if isinstance(batch, dict):
        return str({k: tuple(v.shape) for k, v in batch.items()})
    return str(tuple(tuple(v.shape) for v in batch))


def make_step_runner(steps: Steps, accumulation: int) -> Callable[[Any, dict], dict]:
    """Return ``run(step_batch, metrics) -> metrics`` doing one optimizer step, one mx.eval per micro-batch."""
    single = accumulation == 1 and steps.world_size == 1

    def call(micro: Any, grads: Any, metrics: dict, update: bool, one: bool):
        try:
            return steps.micro(micro, grads, metrics, update=update, single=one)
        except DataError:
            raise
        except ValueError as error:  # MLX reports shape mismatches as ValueError
            raise DataError(
                f"the model failed on a batch of shapes {describe_shapes(micro)}: {error}. Check that the "
                "dataset's arrays match what the model expects (feature size, dtype, sequence layout)"
            ) from error

    if accumulation == 1:
        def run_single(batch: Any, metrics: dict) -> dict:
            _, metrics = call(batch, None, metrics, True, single)
            mx.eval(steps.state, metrics)
            return metrics

        return run_single

    def run(batch: Any, metrics: dict) -> dict:
        micro_batches = split_batch(batch, accumulation)
        grads = None
        last = len(micro_batches) - 1
        for i, micro in enumerate(micro_batches):
            grads, metrics = call(micro, grads, metrics, i == last, False)
            mx.eval(steps.state, grads, metrics)
        return metrics

    return run

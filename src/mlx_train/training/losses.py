"""Loss conventions: how the Trainer calls a loss and reads a batch.

A loss is written one of two ways, and the Trainer tells them apart by the name of the
first parameter:

- ``loss_fn(model, batch)`` -- the first parameter is named ``model`` (as in mlx-lm). It
  returns ``loss``, ``(loss, n_items)`` or ``(loss, n_items, metrics)``: ``metrics`` is a dict
  of scalar means over the same items (e.g. a preference loss's reward accuracy), summed on the
  device like the loss and reported under their names (``val_<name>`` in validation); a loss
  that lists their names in a ``metric_names`` attribute saves one retrace of the step. If it
  takes more than two parameters and the batch is a tuple, it is called as
  ``loss_fn(model, *batch)``.
- ``loss_fn(predictions, targets)`` -- anything else (Keras / PyTorch style, e.g.
  ``mlx.nn.losses.cross_entropy``). The Trainer runs ``model(inputs)``; per-sample losses
  are averaged (over the mask, when the batch has one).

A ``loss_fn(model, batch)`` may also build the batch it trains on from the one the loader gives:
a loss with a ``prepare(model, batch, step)`` method (``BatchPreparer``; reinforcement learning
samples its rollouts there) has it called on every batch in the main thread, right before the step
runs on it with the current weights (and before an evaluation batch, with ``step`` None). The step,
gradient accumulation and out-of-memory splitting then cut the prepared batch.

With no loss the default is cross-entropy for integer targets. A batch is ``(inputs, targets)``,
``(inputs, targets, mask)``, a dict with ``inputs``/``targets`` (also ``x``/``y``,
``input_ids``/``labels``) and optional ``mask``, or ``{"tokens": ..., "mask": ...}`` for
next-token prediction (inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

from mlx_train.errors import ConfigError, DataError

_INPUT_KEYS = ("inputs", "x", "input_ids", "input", "features", "image", "images")
_TARGET_KEYS = ("targets", "y", "labels", "label", "target")
#: Running-sum keys of a loss's extra metrics: ``metric:<name>`` holds the metric times the items.
METRIC_PREFIX = "metric:"
#: The running sums since the last report are ``window:<key>`` beside the epoch's ``<key>``: a report reads its
#: own window, where a difference of two large float32 epoch sums loses precision late in a long epoch.
WINDOW_PREFIX = "window:"


@dataclass(frozen=True)
class Parts:
    """A batch taken apart: what goes into the model, what comes out, which items count."""

    inputs: Any
    targets: mx.array | None
    mask: mx.array | None


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch (the first axis of its first array)."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(first.shape[0])


def split_parts(batch: Any) -> Parts:
    """Take a batch apart into inputs, targets and mask (see the module docstring)."""
    if isinstance(batch, dict):
        if "tokens" in batch and not any(k in batch for k in _TARGET_KEYS):
            tokens = batch["tokens"]
            mask = batch.get("mask")
            return Parts(tokens[:, :-1], tokens[:, 1:], None if mask is None else mask[:, 1:])
        inputs = next((batch[k] for k in _INPUT_KEYS if k in batch), None)
        targets = next((batch[k] for k in _TARGET_KEYS if k in batch), None)
        if inputs is None:
            raise DataError(
                f"batch has keys {sorted(batch)}, but none names the model inputs; "
                f"use one of {list(_INPUT_KEYS)} (or 'tokens' for language modelling), "
                "or pass a loss_fn(model, batch) that reads the batch itself"
            )
        return Parts(inputs, targets, batch.get("mask"))
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return Parts(batch[0], None, None)
        if len(batch) in (2, 3):
            return Parts(batch[0], batch[1], batch[2] if len(batch) == 3 else None)
        raise DataError(
            f"batch is a {type(batch).__name__} of {len(batch)} arrays; expected (inputs, targets) "
            "or (inputs, targets, mask), or pass a loss_fn(model, batch) that reads it itself"
        )
    raise DataError(
        f"batch is a {type(batch).__name__}; expected a tuple (inputs, targets) or a dict of arrays"
    )


def _masked_mean(per_item: mx.array, mask: mx.array | None) -> tuple[mx.array, mx.array]:
    if mask is None:
        return per_item.mean(), mx.array(per_item.size, dtype=mx.float32)
    mask = mask.astype(mx.float32)
    if mask.shape != per_item.shape:
        mask = mx.broadcast_to(mask.reshape(mask.shape + (1,) * (per_item.ndim - mask.ndim)), per_item.shape)
    n = mask.sum()
    return (per_item * mask).sum() / mx.maximum(n, 1.0), n


#: Losses of ``mlx.nn.losses`` taken as ``loss_fn(predictions, targets)`` by name, plus Keras' short names with the
#: same meaning ("mse", "mae"). Each is averaged over the samples (and a mask), as any per-sample loss is.
NAMED_LOSSES = ("binary_cross_entropy", "cross_entropy", "hinge_loss", "huber_loss", "kl_div_loss", "l1_loss",
                "log_cosh_loss", "mse_loss", "nll_loss", "smooth_l1_loss")
_KERAS_NAMES = {"mse": "mse_loss", "mean_squared_error": "mse_loss", "mae": "l1_loss", "mean_absolute_error": "l1_loss"}


def named_loss(name: str) -> Callable[..., Any]:
    """The loss function a ``loss_fn`` string names: one of ``NAMED_LOSSES`` (``mlx.nn.losses``), or "mse"/"mae".

    Example: ``named_loss("mse")  # mlx.nn.losses.mse_loss``
    """
    import mlx.nn.losses as mlx_losses

    key = _KERAS_NAMES.get(name.lower(), name.lower())
    if key in NAMED_LOSSES:
        function: Callable[..., Any] = getattr(mlx_losses, key)
        return function
    keras = ("; Keras' crossentropy names expect probabilities by default, mlx's cross_entropy expects logits: for "
             "classification leave loss_fn out (cross-entropy on logits) or pass 'cross_entropy'"
             if "crossentropy" in name.lower() else "")
    raise ConfigError(f"unknown loss_fn {name!r}: name one of mlx.nn.losses ({', '.join(NAMED_LOSSES)}), 'mse' or "
                      f"'mae', or pass a function{keras}")


def cross_entropy_loss(predictions: mx.array, targets: mx.array) -> mx.array:
    """Per-item cross-entropy in float32 for integer class targets (the default loss)."""
    _check_classification(predictions, targets)
    return nn.losses.cross_entropy(predictions.astype(mx.float32), targets)


def _check_classification(predictions: mx.array, targets: mx.array | None) -> None:
    if targets is None:
        raise DataError("the default loss needs targets, but the batch has none: pass (inputs, targets)")
    if mx.issubdtype(targets.dtype, mx.floating):
        raise DataError(
            f"the default loss is cross-entropy for integer class targets, but the targets are "
            f"{targets.dtype}; pass loss_fn=mlx.nn.losses.mse_loss (or another loss) to the Trainer, "
            "or cast the labels to int32"
        )
    if predictions.shape[:-1] != targets.shape:
        raise DataError(
            f"model output has shape {tuple(predictions.shape)} but targets have shape "
            f"{tuple(targets.shape)}; for cross-entropy the output must be targets' shape + (num_classes,)"
        )


def takes_model_first(loss_fn: Callable[..., Any]) -> bool:
    """True when ``loss_fn``'s first parameter is named ``model`` (the mlx-lm convention)."""
    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].name == "model"


def _positional_count(fn: Callable[..., Any]) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return 99
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def add_metrics(sums: dict[str, Any], metrics: dict[str, mx.array], n: mx.array,
                keep: mx.array | None = None) -> dict[str, Any]:
    """``sums`` with each metric times ``n`` added under ``metric:<name>`` (nothing where ``keep`` is False)."""
    sums = dict(sums)
    for name, value in metrics.items():
        key = METRIC_PREFIX + name
        weighted = value.astype(mx.float32) * n
        sums[key] = sums.get(key, mx.array(0.0)) + (weighted if keep is None else mx.where(keep, weighted, 0.0))
    return sums


def metric_means(sums: dict[str, float], items: float, prefix: str = "") -> dict[str, float]:
    """The mean of each ``metric:<name>`` sum over ``items``, named ``prefix + name``."""
    return {prefix + k[len(METRIC_PREFIX):]: v / max(items, 1e-9) for k, v in sums.items()
            if k.startswith(METRIC_PREFIX)}


@runtime_checkable
class BatchPreparer(Protocol):
    """A loss that turns each loader batch into the batch its step trains on (``Loss.prepare``).

    Example::

        class RolloutLoss:
            def prepare(self, model, batch, step):   # step: optimizer steps taken (None: evaluation)
                return sample_and_score(model, batch, step)      # a dict of arrays, rows first
            def __call__(self, model, batch): ...
    """

    def prepare(self, model: nn.Module, batch: Any, step: int | None) -> Any: ...


class Loss:
    """Wraps a user loss so the step can call ``loss(model, batch) -> (mean, n_items, outputs, metrics)``.

    ``outputs`` are the model's predictions when the Trainer ran the model itself (used for
    accuracy), else None; ``metrics`` the extra means a ``loss_fn(model, batch)`` returned ({} if none).
    """

    def __init__(self, loss_fn: Callable[..., Any] | str | None = None) -> None:
        loss_fn = named_loss(loss_fn) if isinstance(loss_fn, str) else loss_fn
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(f"loss_fn must be a function, loss_fn(predictions, targets) or loss_fn(model, batch), or "
                              f"the name of one of mlx.nn.losses ({', '.join(sorted(NAMED_LOSSES))}); got "
                              f"{type(loss_fn).__name__} {loss_fn!r}")
        self.loss_fn = loss_fn
        self.model_style = loss_fn is not None and takes_model_first(loss_fn)
        self.unpack = self.model_style and _positional_count(loss_fn) > 2  # type: ignore[arg-type]  # model_style: set
        self.name = getattr(loss_fn, "__name__", type(loss_fn).__name__) if loss_fn else "cross_entropy"
        self.metric_names: tuple[str, ...] = tuple(getattr(loss_fn, "metric_names", ()))
        self._prepare = loss_fn.prepare if isinstance(loss_fn, BatchPreparer) else None

    def prepare(self, model: nn.Module, batch: Any, step: int | None) -> Any:
        """The batch a step (or an evaluation, ``step`` None) runs on: the loss's own ``prepare`` for a
        ``BatchPreparer``, else ``batch`` as it is. ``step``: optimizer steps taken before this batch's."""
        return batch if self._prepare is None else self._prepare(model, batch, step)

    def __call__(self, model: nn.Module, batch: Any) -> tuple[mx.array, mx.array, mx.array | None, dict[str, mx.array]]:
        if self.model_style:
            return self._call_model_style(model, batch)
        parts = split_parts(batch)
        outputs = model(parts.inputs)
        fn = self.loss_fn or cross_entropy_loss
        try:
            value = fn(outputs, parts.targets)  # type: ignore[arg-type]  # no targets: fails here, a DataError
        except (TypeError, ValueError) as e:
            raise DataError(
                f"loss '{self.name}' was called as loss_fn(predictions, targets) and failed: {e}. "
                "If it expects (model, batch), name its first parameter 'model'"
            ) from e
        value = mx.array(value) if not isinstance(value, mx.array) else value
        if value.ndim == 0:
            n = mx.array(parts.targets.shape[0] if parts.targets is not None else outputs.shape[0], mx.float32)
            return value.astype(mx.float32), n, outputs, {}
        if parts.targets is not None and value.shape[0] != parts.targets.shape[0]:
            raise DataError(
                f"loss '{self.name}' returned shape {tuple(value.shape)}; expected a scalar or one value "
                f"per sample (first axis {parts.targets.shape[0]})"
            )
        mean, n = _masked_mean(value.astype(mx.float32), parts.mask)
        return mean, n, outputs, {}

    def _call_model_style(self, model: nn.Module,
                          batch: Any) -> tuple[mx.array, mx.array, mx.array | None, dict[str, mx.array]]:
        try:
            # model_style implies a loss_fn: it is never None here.
            out = (self.loss_fn(model, *batch)  # type: ignore[misc]
                   if self.unpack and isinstance(batch, (tuple, list))
                   else self.loss_fn(model, batch))  # type: ignore[misc]
        except (TypeError, ValueError) as e:
            raise DataError(
                f"loss '{self.name}' was called as loss_fn(model, batch) (its first parameter is named "
                f"'model') and failed: {e}. Rename the first parameter if it expects (predictions, targets)"
            ) from e
        metrics: dict[str, mx.array] = {}
        if isinstance(out, (tuple, list)):
            if len(out) not in (2, 3) or (len(out) == 3 and not isinstance(out[2], dict)):
                raise DataError(f"loss '{self.name}' returned {len(out)} values; expected loss, (loss, n_items) "
                                "or (loss, n_items, {metric name: mean})")
            value, n = out[0], out[1]
            metrics = dict(out[2]) if len(out) == 3 else {}
        else:
            value, n = out, batch_size_of(batch)
        value = value if isinstance(value, mx.array) else mx.array(value)
        if value.ndim != 0:
            raise DataError(
                f"loss '{self.name}' (model, batch) returned shape {tuple(value.shape)}; it must return a scalar "
                "mean loss (and optionally the number of items it averages over)"
            )
        n = n if isinstance(n, mx.array) else mx.array(n)
        return value.astype(mx.float32), n.astype(mx.float32), None, metrics


def count_correct(outputs: mx.array | None, batch: Any) -> tuple[mx.array, mx.array] | None:
    """(correct, counted) for classification outputs, or None when accuracy does not apply."""
    if outputs is None:
        return None
    try:
        parts = split_parts(batch)
    except DataError:
        return None
    targets = parts.targets
    if targets is None or mx.issubdtype(targets.dtype, mx.floating) or outputs.shape[:-1] != targets.shape:
        return None
    hits = (outputs.argmax(axis=-1) == targets).astype(mx.float32)
    if parts.mask is None:
        return hits.sum(), mx.array(hits.size, mx.float32)
    mask = parts.mask.astype(mx.float32)
    return (hits * mask).sum(), mask.sum()


class CrossEntropyLoss:
    """Cross-entropy as an object, for code written against PyTorch-style losses.

    Example::

        trainer = Trainer(model=model, optimizer=optimizer, loss_fn=CrossEntropyLoss())
    """

    def __init__(self, label_smoothing: float = 0.0) -> None:
        self.label_smoothing = label_smoothing

    def __call__(self, predictions: mx.array, targets: mx.array) -> mx.array:
        _check_classification(predictions, targets)
        return nn.losses.cross_entropy(predictions.astype(mx.float32), targets, label_smoothing=self.label_smoothing)

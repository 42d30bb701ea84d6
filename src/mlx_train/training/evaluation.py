"""Evaluation and prediction that survive out-of-memory and bad batches.

``Evaluator`` runs the compiled evaluation step over a loader, in as many parts per batch as
memory needs: on out-of-memory the model's state is put back and the batch split in two (the
split is remembered); at one sample per part an ``OutOfMemoryError`` says what to do. Any failure
leaves the model's parameters and MLX's random state usable, and a batch of the wrong shape is a
``DataError`` naming its shapes.

Example::

    evaluator = Evaluator(model, Loss(), precision="float32", log=print)
    sums = evaluator.sums(loader)                   # {"loss_sum": ..., "items": ..., "correct": ...}
    outputs = evaluator.predict(loader)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_train.data import DataLoader
from mlx_train.errors import DataError, MLXTrainError, OutOfMemoryError
from mlx_train.training.labels import LabelCheck
from mlx_train.training.losses import METRIC_PREFIX, Loss, metric_means, split_parts
from mlx_train.training.oom import array_slots, is_out_of_memory
from mlx_train.training.state import set_rng_key
from mlx_train.training.step import build_eval_step, describe_shapes, split_batch


class Evaluator:
    """Evaluates and predicts with ``model`` (see the module docstring)."""

    def __init__(self, model: nn.Module, loss: Loss, precision: str = "float32", compile: bool = True,
                 log: Callable[[str], None] = print) -> None:
        self.model, self.loss, self.log = model, loss, log
        self.precision, self.compile = precision, compile
        self.parts = 1  # each batch is split into this many parts (more after running out of memory)
        self._step: Callable[[Any, dict[str, mx.array]], dict[str, mx.array]] | None = None

    def metrics(self, loader: Iterable[Any], max_batches: int | None, reduce: Callable[[Any], dict[str, float]],
                settled: int | None = None, batch_size: int = 1) -> dict[str, float]:
        """``val_loss`` (and ``val_accuracy``, the loss's metrics, ``val_time``) over ``loader``, the sums
        reduced over ranks by ``reduce``. ``settled``: the micro-batch training settled on after running out of
        memory; each evaluation batch of ``batch_size`` is then split to fit it."""
        start = time.perf_counter()
        if settled:
            self.parts = max(self.parts, -(-batch_size // settled))
        values = reduce(self.sums(loader, max_batches))
        out = {"val_loss": values["loss_sum"] / max(values["items"], 1.0)}
        out.update(metric_means(values, values["items"], "val_"))
        if "correct" in values:
            out["val_accuracy"] = values["correct"] / max(values["counted"], 1.0)
        out["val_time"] = time.perf_counter() - start
        return out

    def sums(self, loader: Iterable[Any], max_batches: int | None = None) -> dict[str, mx.array]:
        """Loss sum and item count (and accuracy counts where they apply) over ``loader``'s batches."""
        if self._step is None:
            self._step = build_eval_step(self.model, self.loss, self.precision, self.compile)
        step = self._step
        sums = {"loss_sum": mx.array(0.0), "items": mx.array(0.0)}
        sums.update({METRIC_PREFIX + name: mx.array(0.0) for name in self.loss.metric_names})
        labels = LabelCheck.for_run(self.loss, self.model, loader)
        self.model.eval()
        try:
            for index, batch in enumerate(loader):
                if max_batches is not None and index >= max_batches:
                    if isinstance(loader, DataLoader):
                        loader.set_epoch(loader.epoch + 1)  # the next validation starts from its first batch
                    break
                batch = self.loss.prepare(self.model, batch, None)
                if labels is not None:
                    labels.batch(batch)
                sums = self._recovering("evaluation", batch, step, sums)
        finally:
            self.model.train()
        return sums

    def predict(self, loader: Iterable[Any]) -> mx.array:
        """Model outputs for every sample, in order."""
        self.model.eval()
        outputs: list[mx.array] = []
        try:
            for batch in loader:
                outputs += self._recovering("prediction", batch,
                                            lambda part, acc: acc + [self.model(split_parts(part).inputs)], [])
        finally:
            self.model.train()
        return mx.concatenate(outputs, axis=0)

    def _recovering(self, what: str, batch: Any, run: Callable[[Any, Any], Any], acc: Any) -> Any:
        while True:
            slots = array_slots([self.model.state], [])
            saved, key = [c[k] for c, k in slots], mx.random.state[0]  # type: ignore[index]  # a list
            parts = split_batch(batch, min(self.parts, _rows(batch)))
            try:
                result = acc
                for part in parts:
                    result = run(part, result)
                    mx.eval(result)
                return result
            except BaseException as error:
                for (container, name), value in zip(slots, saved, strict=False):
                    container[name] = value
                set_rng_key(key.tolist())
                if isinstance(error, ValueError) and not isinstance(error, MLXTrainError):
                    raise DataError(f"the model failed on a {what} batch of shapes {describe_shapes(batch)}: {error}. "
                                    "Check that this dataset's arrays match what the model was trained on (feature "
                                    "size, dtype, sequence layout)") from error
                if not isinstance(error, Exception) or isinstance(error, MLXTrainError) or not is_out_of_memory(error):
                    raise
                if len(parts) >= _rows(batch):
                    raise OutOfMemoryError(
                        f"out of memory during {what}: {error} (even with each batch split down to one sample). The "
                        "model is unchanged and usable. To fix: set a smaller eval_batch_size with shorter sequences, "
                        "precision='bfloat16', or use a machine with more memory") from error
                mx.clear_cache()
                self.parts = len(parts) * 2
                self.log(f"out of memory during {what}; splitting each batch into {self.parts} parts")


def _rows(batch: Any) -> int:
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) \
        else batch
    return int(first.shape[0])

"""Class labels checked before they reach the default loss.

An integer label outside ``[0, num_classes)`` makes MLX's cross-entropy gather read outside its
array: on the CPU that corrupts memory and crashes the process (or, for negative labels, trains
silently to nonsense). ``LabelCheck`` stops it before anything is computed, with a ``DataError``
naming the value and the sample. ``num_classes`` comes from one forward pass of the model on one
sample (eval mode, the random state put back). An array-backed dataset is checked once, whole
(no cost per step); other datasets are checked batch by batch, on the host.

Example::

    check = LabelCheck.for_run(loss, model, loader)     # None when the loss is not the default one
    check.batch(batch)                                   # before each step (a no-op once checked whole)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlx_train.errors import DataError
from mlx_train.training.losses import Loss, split_parts
from mlx_train.training.state import set_rng_key


def _targets_of(arrays: Any) -> Any:
    try:
        return split_parts(arrays).targets
    except DataError:
        return None


def _inputs_of(arrays: Any) -> Any:
    try:
        return split_parts(arrays).inputs
    except DataError:
        return None


class LabelCheck:
    """Checks integer class labels against the model's number of outputs (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.num_classes: int | None = None
        self.whole_checked = False

    @classmethod
    def for_run(cls, loss: Loss, model: Any, loader: Any) -> LabelCheck | None:
        if loss.loss_fn is not None:
            return None  # a user loss decides what its targets mean
        check = cls(model)
        arrays = loader.arrays() if hasattr(loader, "arrays") else None
        if arrays is not None and not isinstance(arrays, dict) or isinstance(arrays, dict) and "tokens" not in arrays:
            targets, inputs = _targets_of(arrays), _inputs_of(arrays)
            if targets is not None and inputs is not None and len(inputs):
                check._whole(np.asarray(targets), inputs)
        return check

    def batch(self, batch: Any) -> None:
        """Check one batch (skipped when the whole dataset was checked)."""
        if self.whole_checked:
            return
        parts = split_parts(batch)
        if parts.targets is None or isinstance(batch, dict) and "tokens" in batch:
            return
        targets = np.asarray(parts.targets)
        if targets.dtype.kind in "iu" and self.num_classes is None:
            self.num_classes = self._classes(parts.inputs)
        self._check(targets, None, "in this batch")

    def _whole(self, targets: np.ndarray, inputs: Any) -> None:
        if targets.dtype.kind in "iu":
            self.num_classes = self._classes(np.asarray(inputs[:1]))
        self._check(targets, np.arange(len(targets)), "of the dataset")
        self.whole_checked = True

    def _classes(self, inputs: Any) -> int | None:
        key = mx.random.state[0]  # type: ignore[index]  # a list; the stubs say object
        was_training = self.model.training
        self.model.eval()
        try:
            outputs = self.model(mx.array(np.asarray(inputs)[:1]))
            mx.eval(outputs)
        except Exception:
            return None  # the step itself reports inputs the model cannot take, with their shapes
        finally:
            self.model.train(was_training)
            set_rng_key(key.tolist())
        return int(outputs.shape[-1]) if outputs.ndim >= 1 else None

    def _check(self, targets: np.ndarray, index: np.ndarray | None, where: str) -> None:
        kind = targets.dtype.kind  # (text labels never get here: the DataLoader refuses them with advice)
        if kind not in "iu" or self.num_classes is None or targets.size == 0:
            return
        flat = targets.reshape(len(targets), -1) if targets.ndim > 1 else targets.reshape(-1, 1)
        bad = (flat < 0) | (flat >= self.num_classes)
        if not bad.any():
            return
        row = int(np.nonzero(bad.any(axis=1))[0][0])
        value = int(flat[row][bad[row]][0])
        sample = f"sample {int(index[row])} {where}" if index is not None else f"row {row} {where}"
        raise DataError(
            f"class label {value} ({sample}) is outside [0, {self.num_classes}): the model has {self.num_classes} "
            f"outputs, one per class. Labels must be 0..{self.num_classes - 1}: shift 1-based labels down by one, "
            "or give the model as many outputs as there are classes")

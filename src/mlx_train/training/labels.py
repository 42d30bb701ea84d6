"""Class labels, and the batch's layout, checked before they reach the default loss.

A dict batch with keys the default loss does not read (it reads one inputs key, one targets key and
``mask``), or a mask that is zero for every sample of an array-backed dataset (the loss would average over
nothing: loss 0, nothing trains), is a ``DataError`` saying what the loss reads and how to fix it.

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
from mlx_train.training.losses import _INPUT_KEYS, _TARGET_KEYS, Loss, split_parts
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
        if arrays is not None:
            check_layout(arrays, whole=True)
        if arrays is not None and not isinstance(arrays, dict) or isinstance(arrays, dict) and "tokens" not in arrays:
            targets, inputs = _targets_of(arrays), _inputs_of(arrays)
            if targets is not None and inputs is not None and len(inputs):
                check._whole(np.asarray(targets), inputs)
        return check

    def batch(self, batch: Any) -> None:
        """Check one batch (skipped when the whole dataset was checked)."""
        if self.whole_checked:
            return
        if self.num_classes is None:  # the first batch: its keys are every batch's
            check_layout(batch, whole=False)
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


def check_layout(batch: Any, whole: bool) -> None:
    """Refuse dict keys the default loss would ignore, and (``whole``: the whole dataset) a mask of zeros."""
    if isinstance(batch, dict):
        if "tokens" in batch and not any(k in batch for k in _TARGET_KEYS):
            read = {"tokens": "the sequences", "mask": "the mask"}
        else:
            inputs = next((k for k in _INPUT_KEYS if k in batch), None)
            targets = next((k for k in _TARGET_KEYS if k in batch), None)
            read = {k: what for k, what in ((inputs, "inputs"), (targets, "targets"), ("mask", "the mask")) if k}
        unused = sorted(k for k in batch if k not in read)
        if unused:
            reads = ", ".join(f"{k!r} as {what}" for k, what in read.items() if k in batch)
            raise DataError(f"the dataset's key(s) {', '.join(map(repr, unused))} are not read by the default loss "
                            f"(it reads {reads}), so they would be ignored: drop them from the dataset, or pass "
                            "loss_fn(model, batch) that reads them")
        mask, where = batch.get("mask"), "its 'mask'"
    elif isinstance(batch, (tuple, list)) and len(batch) == 3:
        mask, where = batch[2], "the third array of (inputs, targets, mask)"
    else:
        return
    if whole and mask is not None and np.asarray(mask).size and not np.asarray(mask).any():
        raise DataError(f"the dataset's mask ({where}) is zero for every sample: the default loss averages over the "
                        "items the mask keeps, so nothing would train (loss 0). A mask is 1 where a sample or "
                        "position counts; if that array is something else (a feature, a weight), pass "
                        "loss_fn(model, batch) that reads it, or leave it out")

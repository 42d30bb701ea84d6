"""Turn a list of samples into one batch of numpy arrays.

Collation runs on the loader's worker threads and produces numpy arrays; the
consumer thread turns them into ``mx.array`` with :func:`to_mx`.

Rules of :func:`pad_collate` (and so of :func:`default_collate`):

- A sample is a tuple of fields ``(x, y, ...)``, a dict of fields, a bare
  array or number, or a bare token sequence.
- A *token sequence* is a Python list of integers or a 1-D integer array, or
  a Python list of floats whose length differs from another one's in the batch.
  Equal-length float lists are feature vectors and are stacked like arrays
  (a Hugging Face dataset's default format yields them as Python lists).
  Token sequences are always padded (never only when their lengths differ, so
  every batch has the same structure) to the longest one rounded up to
  ``multiple`` (32 by default, so ``mx.compile`` sees few shapes):
  - bare sequences become ``{"tokens": int32[B, L], "mask": bool[B, L]}``;
  - a dict field ``f`` becomes ``int32[B, L]`` plus ``"f_mask": bool[B, L]``;
  - a tuple field is padded with ``pad_value`` and gets no mask (tuples keep
    their arity so ``x, y = batch`` works; use dict samples to get masks).
- Everything else is stacked; shapes must match (the error names the sample).
- ``float64`` becomes ``float32`` and ``int64`` becomes ``int32`` (when the
  values fit), the dtypes MLX models use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlx_train.errors import DataError

__all__ = ["default_collate", "pad_collate", "to_mx", "normalize_dtype", "round_up"]

Batch = Any  # tuple/list/dict of numpy arrays (collated) or of mx.array (after to_mx)

_SCALARS = (int, float, bool, np.number, np.bool_)
_INT32 = np.iinfo(np.int32)


def round_up(length: int, multiple: int) -> int:
    """Round ``length`` up to a multiple of ``multiple`` (at least one multiple).

    Example: ``round_up(33, 32) -> 64``.
    """
    return max(1, -(-int(length) // multiple)) * multiple


def normalize_dtype(array: np.ndarray) -> np.ndarray:
    """Return ``array`` with float64 as float32 and int64 as int32 (when the values fit).

    Example: ``normalize_dtype(np.arange(3)).dtype -> int32``.
    """
    if array.dtype == np.float64:
        return array.astype(np.float32)
    if array.dtype == np.int64:
        if array.size == 0 or (array.min() >= _INT32.min and array.max() <= _INT32.max):
            return array.astype(np.int32)
    if array.dtype == object:
        raise DataError(
            "got an array of Python objects (dtype=object), usually ragged nested lists; "
            "give equal-length numeric arrays, or token sequences as a list of samples"
        )
    if array.dtype.kind in "USV":  # MLX has no string or raw-bytes arrays
        raise DataError(
            f"got {'text' if array.dtype.kind == 'U' else 'bytes'} values (dtype {array.dtype}, e.g. "
            f"{array.flat[0]!r}) where numbers are needed; map labels to integer ids first, e.g. "
            "classes, y = np.unique(labels, return_inverse=True)"
        )
    return array


def default_collate(samples: Sequence[Any]) -> Batch:
    """Collate samples with the default rules (see the module docstring).

    Example: ``default_collate([(np.zeros(3), 1), (np.ones(3), 0)])``
    -> ``(float32[2, 3], int32[2])``.
    """
    return pad_collate(samples)


def pad_collate(
    samples: Sequence[Any],
    multiple: int = 32,
    pad_value: int = 0,
    fields: Iterable[str | int] | None = None,
    *,
    indices: Sequence[int] | None = None,
) -> Batch:
    """Stack samples into numpy arrays, padding token sequences to a multiple of ``multiple``.

    ``fields`` names the dict keys / tuple positions to pad (``()`` pads nothing);
    ``None`` pads every token sequence. ``indices`` (the samples' dataset
    indices) only make error messages point at the right sample. Configure it
    for a loader with ``functools.partial``.

    Example::

        pad_collate([{"ids": [1, 2, 3]}, {"ids": [4]}])
        # {"ids": int32[2, 32], "ids_mask": bool[2, 32]}
        DataLoader(rows, collate_fn=functools.partial(pad_collate, multiple=64))
    """
    if len(samples) == 0:
        raise DataError("cannot collate an empty list of samples")
    where = list(indices) if indices is not None else list(range(len(samples)))
    label = "dataset sample" if indices is not None else "sample"
    pad = None if fields is None else set(fields)
    first = samples[0]
    if isinstance(first, Mapping):
        keys = list(first.keys())
        out: dict[str, np.ndarray] = {}
        for key in keys:
            values = [_field(s, key, i, label, where) for i, s in enumerate(samples)]
            if _wants_pad(values, key, pad):
                out[key], out[f"{key}_mask"] = _pad(values, multiple, pad_value, key, label, where)
            else:
                out[key] = _stack(values, f"field '{key}'", label, where)
        return out
    if isinstance(first, tuple) or (isinstance(first, list) and not _is_sequence(first)):
        width = len(first)
        columns = []
        for pos in range(width):
            values = [_field(s, pos, i, label, where, width) for i, s in enumerate(samples)]
            if _wants_pad(values, pos, pad):
                columns.append(_pad(values, multiple, pad_value, f"field {pos}", label, where)[0])
            else:
                columns.append(_stack(values, f"field {pos}", label, where))
        return tuple(columns)
    if _is_sequence(first) and (bool(pad) if pad is not None else _is_tokens(samples)):
        tokens, mask = _pad(samples, multiple, pad_value, "tokens", label, where)
        return {"tokens": tokens, "mask": mask}
    if isinstance(first, (np.ndarray, list, *_SCALARS)) or _is_mx(first):
        return (_stack(samples, "the sample", label, where),)
    raise DataError(
        f"{label} {where[0]} is a {type(first).__name__}; expected a tuple of arrays (x, y), "
        "a dict of arrays, an array, or a list of token ids; convert it in the dataset's "
        "__getitem__ or pass collate_fn= to the DataLoader"
    )


def _is_mx(value: Any) -> bool:
    return type(value).__module__.startswith("mlx")


def _is_sequence(value: Any) -> bool:
    """A sequence that may be padded: a list of numbers or a 1-D integer array."""
    if isinstance(value, list):
        return all(isinstance(v, _SCALARS) for v in value[:8])
    if isinstance(value, np.ndarray) or _is_mx(value):
        return value.ndim == 1 and np.issubdtype(_np_dtype(value), np.integer)
    return False


def _is_integer(value: Any) -> bool:
    if isinstance(value, list):
        return all(isinstance(v, (int, np.integer, np.bool_)) for v in value)
    return bool(np.issubdtype(_np_dtype(value), np.integer))


def _is_tokens(values: Sequence[Any]) -> bool:
    """Token sequences: integer ones, or lists of different lengths (float lists of one length are features)."""
    if not all(_is_sequence(v) for v in values):
        return False
    return any(_is_integer(v) for v in values) or len({len(v) for v in values}) > 1


def _np_dtype(value: Any) -> np.dtype:
    if isinstance(value, np.ndarray):
        return cast("np.dtype[Any]", value.dtype)
    name = str(value.dtype).rsplit(".", 1)[-1]
    return np.dtype(name) if name not in ("bfloat16",) else np.dtype(np.float32)


def _wants_pad(values: Sequence[Any], name: str | int, pad: set[Any] | None) -> bool:
    if pad is None:
        return _is_tokens(values)
    return name in pad


def _field(sample: Any, key: str | int, i: int, label: str, where: list[Any], width: int = 0) -> Any:
    """Fetch one field, with an error naming the sample when it does not match the first."""
    try:
        if isinstance(key, int) and len(sample) != width:
            raise TypeError
        return sample[key]
    except (KeyError, IndexError, TypeError):
        kind = f"key '{key}'" if isinstance(key, str) else f"{width} fields"
        raise DataError(
            f"{label} {where[i]} does not match {label} {where[0]}: expected {kind}, got "
            f"{_describe(sample)}; every sample must have the same structure"
        ) from None


def _describe(sample: Any) -> str:
    if isinstance(sample, Mapping):
        return f"a dict with keys {sorted(map(str, sample))}"
    if isinstance(sample, (tuple, list)):
        return f"a {type(sample).__name__} of {len(sample)} fields"
    return f"a {type(sample).__name__}"


def _stack(values: Sequence[Any], what: str, label: str, where: list[Any]) -> np.ndarray:
    arrays = [np.asarray(v) if not _is_mx(v) else _mx_to_np(v) for v in values]
    shape = arrays[0].shape
    if arrays[0].dtype.kind in "USO":
        raise DataError(
            f"{what} of {label} {where[0]} holds {type(values[0]).__name__} values, not numbers; MLX "
            "arrays hold numbers only: drop that field (e.g. dataset.remove_columns([...])) or encode it "
            "in the dataset, or pass collate_fn="
        )
    for i, a in enumerate(arrays):
        if a.shape != shape or a.dtype == object:
            raise DataError(
                f"{what} of {label} {where[i]} has shape {a.shape} but {label} {where[0]} has "
                f"{shape}; samples in a batch must have equal shapes: resize them, or give "
                "variable-length token ids as lists/1-D int arrays so they are padded (for a Hugging Face "
                'dataset of nested lists, dataset.with_format("numpy") gives the arrays)'
            )
    return normalize_dtype(np.stack(arrays))


def _mx_to_np(value: Any) -> np.ndarray:
    if value.dtype == mx.bfloat16:
        value = value.astype(mx.float32)
    return np.asarray(value)


def _pad(
    values: Sequence[Any], multiple: int, pad_value: int, what: str, label: str, where: list[Any]
) -> tuple[np.ndarray, np.ndarray]:
    seqs = [np.asarray(v) if not _is_mx(v) else _mx_to_np(v) for v in values]
    for i, s in enumerate(seqs):
        if s.ndim != 1:
            raise DataError(
                f"{what} of {label} {where[i]} has shape {s.shape}; only 1-D sequences can be padded "
                "(to a multiple of 32, with a mask): flatten it, leave it out of collate fields=, or give "
                'arrays instead of Python lists (for a Hugging Face dataset: dataset.with_format("numpy"))'
            )
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    dtype = np.int32 if all(s.dtype.kind in "iub" for s in seqs) else np.float32
    out = np.full((len(seqs), round_up(lengths.max(), multiple)), pad_value, dtype=dtype)
    for row, s in zip(out, seqs, strict=False):
        row[: len(s)] = s
    mask = np.arange(out.shape[1]) < lengths[:, None]
    return out, mask


def to_mx(batch: Batch) -> Batch:
    """Convert a collated batch (tuple/list/dict of numpy arrays) to ``mx.array`` leaves.

    Example: ``to_mx((np.zeros((2, 3)), np.arange(2)))`` -> ``(array, array)``.
    """
    if isinstance(batch, tuple):
        return tuple([to_mx(v) for v in batch])
    if isinstance(batch, list):
        return [to_mx(v) for v in batch]
    if isinstance(batch, dict):
        return {k: to_mx(v) for k, v in batch.items()}
    if isinstance(batch, (np.ndarray, *_SCALARS)):
        return mx.array(batch)  # type: ignore[arg-type]  # mlx accepts numpy arrays and scalars
    return batch

"""Adapters that give the DataLoader one way to read each kind of dataset.

- :class:`ArraySource`: a tuple ``(x, y, ...)`` or dict of equal-length arrays
  (numpy or MLX, or a single array); a batch is gathered with one fancy-index
  per array. A *list* is arrays only when it holds at most 8 equal-length arrays
  with more rows than arrays (``[x, y]``); any other list is a list of samples.
- :class:`MapSource`: anything with ``__len__`` and ``__getitem__(int)`` (a list of
  samples, a Hugging Face ``datasets.Dataset``, a PyTorch-style dataset); uses
  ``__getitems__(list)`` when the dataset has it (Hugging Face does).
- :class:`IterableSource`: any other iterable, read lazily in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlx_train.errors import DataError

from .collate import normalize_dtype

__all__ = ["ArraySource", "MapSource", "IterableSource", "make_source", "sample_length"]

_MAX_ARRAY_FIELDS = 8
# Arrays up to this size (all fields together) are also held as MLX arrays, and batches are gathered from
# them by MLX: one gather per array in the step's graph instead of a NumPy fancy-index and a copy into MLX.
RESIDENT_MAX_BYTES = 256 << 20


def _is_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, mx.array))


def _to_numpy(value: Any, name: str) -> np.ndarray:
    """Turn one array field into numpy (once, at construction) with MLX-friendly dtypes."""
    if type(value).__module__.startswith("mlx"):
        import mlx.core as mx

        if value.dtype == mx.bfloat16:
            value = value.astype(mx.float32)
        value = np.asarray(value)
    try:
        array = np.asarray(value)
    except ValueError:
        try:
            array = np.asarray(value, dtype=object)
        except ValueError:  # nested sequences numpy cannot even hold as objects
            array = np.empty(0, dtype=object)
    if array.dtype == object:
        raise DataError(
            f"array {name} is ragged (its rows have different lengths) or holds Python objects; "
            "give equal-length numeric arrays, or pass a list of samples "
            "(e.g. [{'tokens': ids}, ...]) so that each batch is padded"
        )
    if array.ndim == 0:
        raise DataError(
            f"array {name} is a scalar; every array needs a first (sample) axis, e.g. shape [N, ...]"
        )
    try:
        return normalize_dtype(array)
    except DataError as e:
        raise DataError(f"array {name}: {e}") from None


_SPLIT_NAMES = {"train", "val", "valid", "validation", "test", "eval", "dev"}


class ArraySource:
    """Equal-length arrays, batched by fancy-indexing each array once."""

    kind = "arrays"

    def __init__(self, arrays: tuple[Any, ...] | list[Any] | Mapping[str, Any]) -> None:
        if isinstance(arrays, Mapping):
            splits = [k for k in arrays if str(k) in _SPLIT_NAMES]
            if splits and all(isinstance(arrays[k], (tuple, list, Mapping)) for k in splits):
                raise DataError(
                    f"the dataset is a dict of splits ({', '.join(map(repr, arrays))}), not one dataset; pass "
                    f"one split, e.g. trainer.train(data['{splits[0]}'], data.get('val'))")
            self.keys: list[str] | None = [str(k) for k in arrays]
            names = [f"'{k}'" for k in arrays]
            self.arrays = [_to_numpy(v, n) for v, n in zip(arrays.values(), names, strict=False)]
        else:
            self.keys = None
            names = [f"{i} of the tuple" for i in range(len(arrays))]
            self.arrays = [_to_numpy(v, n) for v, n in zip(arrays, names, strict=False)]
        if not self.arrays:
            raise DataError("the dataset holds no arrays; pass e.g. (x, y) or {'x': x, 'y': y}")
        lengths = {n: len(a) for n, a in zip(names, self.arrays, strict=False)}
        if len(set(lengths.values())) > 1:
            listed = ", ".join(f"{n}: {size}" for n, size in lengths.items())
            raise DataError(
                f"dataset arrays have different lengths ({listed}); every array must have one "
                "row per sample along axis 0"
            )
        self.dataset = arrays
        self.num_samples = len(self.arrays[0])
        self.lengths_cache: dict[Any, np.ndarray] = {}
        self._resident: list[mx.array] | None = None  # None: not decided yet; []: not held

    def resident(self) -> list[mx.array] | None:
        """The arrays as MLX arrays (made once, at the first call), or None when they are larger than
        ``RESIDENT_MAX_BYTES`` or MLX cannot hold them. Their values are those of the NumPy arrays at that
        first call: later changes to the NumPy arrays are not seen."""
        if self._resident is None:
            self._resident = []
            if sum(a.nbytes for a in self.arrays) <= RESIDENT_MAX_BYTES:
                try:
                    self._resident = [mx.array(a) for a in self.arrays]
                except (TypeError, ValueError):  # a dtype MLX has no match for: batches go through NumPy
                    pass
        return self._resident or None

    def gather(self, index: np.ndarray | slice) -> tuple[Any, ...] | dict[str, Any]:
        """One batch as numpy arrays: one fancy-index (or slice) per array."""
        if self.keys is None:
            return tuple([a[index] for a in self.arrays])
        return {k: a[index] for k, a in zip(self.keys, self.arrays, strict=False)}

    def samples(self, index: np.ndarray | slice) -> list[Any]:
        """Per-sample rows, for a user collate_fn (slower than gather)."""
        rows = range(self.num_samples)[index] if isinstance(index, slice) else index
        if self.keys is None:
            return [tuple(a[i] for a in self.arrays) for i in rows]
        return [{k: a[i] for k, a in zip(self.keys, self.arrays, strict=False)} for i in rows]


class MapSource:
    """A dataset read by index: ``dataset[i]`` (or ``dataset.__getitems__(indices)``)."""

    kind = "map"

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.num_samples = len(dataset)
        self.lengths_cache: dict[Any, np.ndarray] = {}
        many = getattr(dataset, "__getitems__", None)
        self._getitems: Callable[..., Any] | None = many if callable(many) else None

    def samples(self, index: np.ndarray | slice) -> list[Any]:
        """The samples at ``index``, read from the dataset."""
        rows = range(self.num_samples)[index] if isinstance(index, slice) else index.tolist()
        if self._getitems is not None:
            return list(self._getitems(list(rows)))
        get = self.dataset.__getitem__
        out = []
        for i in rows:
            try:
                out.append(get(i))
            except Exception as e:
                # Name the failing sample without hiding the user's own traceback (Python >= 3.11).
                if hasattr(e, "add_note"):
                    e.add_note(f"while reading sample {i} of the dataset ({type(self.dataset).__name__})")
                raise
        return out


class IterableSource:
    """An iterable without ``__len__``: read in order, one pass per epoch."""

    kind = "iterable"
    num_samples = None

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.stateful = callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None)
        )
        self.one_shot = iter(dataset) is dataset  # a generator or iterator: one pass only
        self.lengths_cache: dict[Any, np.ndarray] = {}

    def open(self) -> Iterator[Any]:
        return iter(self.dataset)


def make_source(dataset: Any) -> ArraySource | MapSource | IterableSource:
    """Pick the adapter for ``dataset`` (arrays, map-style or iterable)."""
    if dataset is None:
        raise DataError("dataset is None; pass arrays (x, y), a dict of arrays, or a dataset")
    if isinstance(dataset, (str, bytes)):
        raise DataError(
            f"dataset is a {type(dataset).__name__}; a file name is not a dataset: load it "
            "first (e.g. mlx_train.builtin.datasets.load_dataset) and pass arrays or samples"
        )
    if _is_array(dataset):
        return ArraySource((dataset,))
    if isinstance(dataset, tuple) or _looks_like_array_list(dataset):
        return ArraySource(dataset)
    if isinstance(dataset, Mapping) and not _has_int_keys(dataset):
        if all(not isinstance(v, (str, bytes)) for v in dataset.values()):
            return ArraySource(dataset)
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return MapSource(dataset)
    if hasattr(dataset, "__iter__"):
        return IterableSource(dataset)
    raise DataError(
        f"dataset of type {type(dataset).__name__} is not usable: expected arrays (x, y) or a "
        "dict of arrays, an object with __len__ and __getitem__, or an iterable"
    )


def _looks_like_array_list(dataset: Any) -> bool:
    """A list ``[x, y]`` of a few equal-length arrays is arrays; any other list is samples."""
    if not isinstance(dataset, list) or not 0 < len(dataset) <= _MAX_ARRAY_FIELDS:
        return False
    if not all(_is_array(a) and a.ndim >= 1 for a in dataset):
        return False
    rows = {a.shape[0] for a in dataset}
    return len(rows) == 1 and rows.pop() > len(dataset)


def _has_int_keys(mapping: Mapping[str, Any]) -> bool:
    return any(isinstance(k, (int, np.integer)) for k in list(mapping.keys())[:1])


def sample_length(sample: Any, field: str | int | None, index: int) -> int:
    """The sequence length of one sample, for length bucketing."""
    if field is not None:
        try:
            return len(sample[field])
        except (KeyError, IndexError, TypeError):
            raise DataError(
                f"sample {index} has no sequence field {field!r} to measure for length "
                "bucketing; pass lengths= as a list of ints or the name of a sequence field"
            ) from None
    if isinstance(sample, Mapping):
        for name in ("tokens", "input_ids", "ids", "text"):
            if name in sample:
                return len(sample[name])
        for value in sample.values():
            if isinstance(value, (list, np.ndarray)) or _is_array(value):
                return len(value)
    elif isinstance(sample, tuple) and sample:
        return len(sample[0])
    elif isinstance(sample, (list, np.ndarray)) or _is_array(sample):
        return len(sample)
    raise DataError(
        f"cannot tell the length of sample {index} ({type(sample).__name__}) for length "
        "bucketing; pass lengths= (a list of ints, or the name of the sequence field)"
    )


def lengths_of(source: Any, spec: Sequence[int] | np.ndarray | str | int | None) -> np.ndarray:
    """Per-sample lengths from ``spec`` (given, or measured once by reading every sample)."""
    if spec is not None and not isinstance(spec, (str, int)):
        lengths = np.asarray(spec, dtype=np.int64)
        if lengths.ndim != 1 or len(lengths) != source.num_samples:
            raise DataError(
                f"lengths= has {lengths.size} entries but the dataset has {source.num_samples} "
                "samples; give one length per sample"
            )
        return lengths
    if spec in source.lengths_cache:
        return cast(np.ndarray, source.lengths_cache[spec])
    if isinstance(source, ArraySource):
        raise DataError(
            "length bucketing needs per-sample lengths, and arrays datasets are rectangular; "
            "pass lengths= (one int per sample), e.g. LengthBucketing(lengths=mask.sum(axis=1))"
        )
    dataset = source.dataset
    if isinstance(spec, str) and hasattr(dataset, "column_names"):
        lengths = np.array([len(v) for v in dataset[spec]], dtype=np.int64)  # one column read
    else:
        rows = source.samples(slice(0, source.num_samples))
        lengths = np.array([sample_length(s, spec, i) for i, s in enumerate(rows)], dtype=np.int64)
    source.lengths_cache[spec] = lengths
    return lengths

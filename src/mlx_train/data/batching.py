"""Which samples go in which batch: the epoch plan, length bucketing and token budgets.

An epoch's plan is an ``order`` (every sample index used this epoch, in order)
and ``bounds`` (global batch ``k`` is ``order[bounds[k]:bounds[k + 1]]``). It is
computed from index lists and per-sample lengths only, never by reading
samples, so a position in an epoch is restored by arithmetic. A rank takes a
contiguous, balanced slice of each global batch (``batch_size`` samples each
when the batch is full).

A batching strategy is any object with ``describe() -> dict`` (JSON-able,
stored in the loader state), a ``lengths`` attribute (``None`` when it needs
none) and ``arrange(order, lengths, rng, batch_size, world_size, drop_last)
-> (order, bounds)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from mlx_train.errors import DataError

from .collate import round_up

__all__ = ["EpochPlan", "LengthBucketing", "RepeatedBatches", "TokenBudget", "plan_epoch", "fixed_bounds",
           "fixed_layout"]

LengthSpec = Sequence[int] | np.ndarray | str | int | None


@dataclass(frozen=True)
class EpochPlan:
    """The batches of one epoch for one rank."""

    order: np.ndarray | None  # sample indices in epoch order; None means 0..n-1
    bounds: np.ndarray  # global batch k is order[bounds[k]:bounds[k+1]]
    starts: Sequence[int]  # this rank's slice of global batch k is order[starts[k]:stops[k]]
    stops: Sequence[int]

    @property
    def num_batches(self) -> int:
        return len(self.starts)


def fixed_bounds(num_samples: int, global_batch: int, world_size: int, drop_last: bool) -> np.ndarray:
    """Boundaries of fixed-size global batches; a partial last batch needs >= world_size samples.

    Example: ``fixed_bounds(10, 4, 1, False) -> [0, 4, 8, 10]``.
    """
    full, rest = divmod(num_samples, global_batch)
    keep_partial = rest > 0 and not drop_last and rest >= world_size
    bounds = np.arange(full + 1, dtype=np.int64) * global_batch
    if keep_partial:
        bounds = np.append(bounds, num_samples)
    return bounds


def rank_slices(bounds: np.ndarray, rank: int, world_size: int) -> tuple[list[int], list[int]]:
    """Rank ``rank``'s contiguous, balanced slice of every global batch."""
    sizes = np.diff(bounds)
    share, extra = np.divmod(sizes, world_size)
    starts = bounds[:-1] + rank * share + np.minimum(rank, extra)
    stops = starts + share + (rank < extra)
    return starts.tolist(), stops.tolist()


@lru_cache(maxsize=32)
def fixed_layout(num_samples: int, batch_size: int, rank: int, world_size: int,
                 drop_last: bool) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]:
    """``(bounds, starts, stops)`` of fixed-size batches: the same every epoch (only the order changes), so
    it is computed once per geometry and shared (read-only: ``bounds`` cannot be written, the rest are tuples).

    Example: ``fixed_layout(10, 4, 0, 1, False) -> ([0, 4, 8, 10], (0, 4, 8), (4, 8, 10))``.
    """
    bounds = fixed_bounds(num_samples, batch_size * world_size, world_size, drop_last)
    bounds.flags.writeable = False
    starts, stops = rank_slices(bounds, rank, world_size)
    return bounds, tuple(starts), tuple(stops)


def plan_epoch(
    num_samples: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    geometry: tuple[int, int, int, bool],
    batching: Any = None,
    lengths: np.ndarray | None = None,
) -> EpochPlan:
    """Plan epoch ``epoch``: the permutation from ``default_rng([seed, epoch])``, then batches.

    ``geometry`` is ``(batch_size, rank, world_size, drop_last)``.

    Example: ``plan_epoch(10, 0, 0, False, (4, 0, 1, False)).bounds -> [0, 4, 8, 10]``.
    """
    batch_size, rank, world_size, drop_last = geometry
    rng = np.random.default_rng([seed, epoch]) if shuffle else None
    order = rng.permutation(num_samples) if rng is not None else None
    if batching is None:  # only the order depends on the epoch
        return EpochPlan(order, *fixed_layout(num_samples, batch_size, rank, world_size, drop_last))
    if order is None:
        order = np.arange(num_samples)
    order, bounds = batching.arrange(order, lengths, rng, batch_size, world_size, drop_last)
    starts, stops = rank_slices(bounds, rank, world_size)
    return EpochPlan(order, bounds, starts, stops)


def _sort_in_windows(order: np.ndarray, lengths: np.ndarray, window: int) -> np.ndarray:
    """Sort ``order`` by length inside consecutive windows of ``window`` samples (stable)."""
    window_id = np.arange(len(order)) // window
    return order[np.lexsort((lengths[order], window_id))]


def _shuffle_batches(
    order: np.ndarray, bounds: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Put whole batches in a random order (their contents unchanged)."""
    sizes = np.diff(bounds)
    permuted = rng.permutation(len(sizes))
    rank_of_batch = np.empty_like(permuted)
    rank_of_batch[permuted] = np.arange(len(sizes))
    batch_of_sample = np.repeat(rank_of_batch, sizes)
    moved = order[: bounds[-1]][np.argsort(batch_of_sample, kind="stable")]
    return moved, np.concatenate([[0], np.cumsum(sizes[permuted])])


def _check_lengths(lengths: np.ndarray | None, name: str) -> np.ndarray:
    if lengths is None:
        raise DataError(f"{name} needs per-sample lengths; pass lengths= (a list of ints or a field name)")
    return lengths


def _check_positive(value: Any, name: str) -> None:
    if value is not None and (not isinstance(value, (int, np.integer)) or value <= 0):
        raise DataError(f"{name} must be a positive integer, got {value!r}")


class LengthBucketing:
    """Fixed-size batches of samples of similar length, so padding wastes little.

    Each epoch takes the seeded permutation, sorts it by length inside windows of
    ``window`` samples (default: 100 global batches), cuts it into batches and
    shuffles the batch order with the same generator. Batch composition changes
    every epoch; it is a function of (seed, epoch) and the lengths only.
    ``lengths``: one int per sample, the name (or tuple position) of the sequence
    field to measure, or ``None`` to measure each sample's token sequence (read once).

    Example::

        loader = DataLoader(rows, batch_size=16, batching=LengthBucketing(lengths="input_ids"))
    """

    def __init__(self, lengths: LengthSpec = None, window: int | None = None) -> None:
        _check_positive(window, "LengthBucketing window")
        self.lengths = lengths
        self.window = window

    def describe(self) -> dict[str, Any]:
        return {"name": "LengthBucketing", "window": self.window}

    def arrange(
        self,
        order: np.ndarray,
        lengths: np.ndarray | None,
        rng: np.random.Generator | None,
        batch_size: int,
        world_size: int,
        drop_last: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        global_batch = batch_size * world_size
        window = round_up(self.window or 100 * global_batch, global_batch)
        order = _sort_in_windows(order, _check_lengths(lengths, "LengthBucketing"), window)
        bounds = fixed_bounds(len(order), global_batch, world_size, drop_last)
        if rng is not None:
            order, bounds = _shuffle_batches(order, bounds, rng)
        return order, bounds


class TokenBudget:
    """Dynamic batches: as many samples as fit in ``max_tokens`` padded tokens per rank.

    Samples are sorted by length inside windows of ``window`` samples (default
    4096) of the seeded permutation, then cut greedily so that
    ``samples_per_rank * padded_length <= max_tokens``, where ``padded_length`` is
    the longest length rounded up to ``multiple`` (match your collate's). The
    batch order is then shuffled. ``batch_size`` and ``drop_last`` are ignored;
    with several ranks a last batch with fewer samples than ranks is dropped.

    Example::

        loader = DataLoader(rows, batching=TokenBudget(max_tokens=8192, lengths="input_ids"))
    """

    def __init__(
        self, max_tokens: int, lengths: LengthSpec = None, multiple: int = 32, window: int | None = None
    ) -> None:
        _check_positive(max_tokens, "TokenBudget max_tokens")
        _check_positive(multiple, "TokenBudget multiple")
        _check_positive(window, "TokenBudget window")
        self.max_tokens = int(max_tokens)
        self.lengths = lengths
        self.multiple = int(multiple)
        self.window = window

    def describe(self) -> dict[str, Any]:
        return {"name": "TokenBudget", "max_tokens": self.max_tokens, "multiple": self.multiple,
                "window": self.window}

    def arrange(
        self,
        order: np.ndarray,
        lengths: np.ndarray | None,
        rng: np.random.Generator | None,
        batch_size: int,
        world_size: int,
        drop_last: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        lengths = _check_lengths(lengths, "TokenBudget")
        order = _sort_in_windows(order, lengths, self.window or 4096)
        m = self.multiple
        padded = (np.maximum(-(-lengths[order] // m), 1) * m).tolist()
        cuts, longest, count = [0], 0, 0
        for i, p in enumerate(padded):
            if p > self.max_tokens:
                raise DataError(
                    f"sample {int(order[i])} has {int(lengths[order[i]])} tokens (padded to {p}), more "
                    f"than TokenBudget max_tokens={self.max_tokens}; raise max_tokens or truncate "
                    "long samples in the dataset"
                )
            grown = max(longest, p)
            if -(-(count + 1) // world_size) * grown > self.max_tokens:
                cuts.append(i)
                longest, count = p, 1
            else:
                longest, count = grown, count + 1
        cuts.append(len(padded))
        bounds = np.asarray(cuts, dtype=np.int64)
        if world_size > 1 and bounds[-1] - bounds[-2] < world_size:
            bounds = bounds[:-1]
        if rng is not None:
            order, bounds = _shuffle_batches(order, bounds, rng)
        return order, bounds


class RepeatedBatches:
    """Every batch of ``batching`` (fixed-size batches when None) handed out ``times`` times in a row: several
    optimizer steps on one batch, as GRPO's ``num_iterations`` trains on one batch of rollouts. An epoch has
    ``times`` times as many batches; a position in it (a repeat included) is restored like any other.

    Example: ``DataLoader(rows, batch_size=2, batching=RepeatedBatches(LengthBucketing(lengths=n), times=2))``.
    """

    def __init__(self, batching: Any = None, times: int = 2) -> None:
        _check_positive(times, "RepeatedBatches times")
        self.batching, self.times = batching, int(times)

    @property
    def lengths(self) -> LengthSpec:
        return getattr(self.batching, "lengths", None)

    def describe(self) -> dict[str, Any]:
        return {"name": "RepeatedBatches", "times": self.times,
                "batching": None if self.batching is None else self.batching.describe()}

    def arrange(
        self,
        order: np.ndarray,
        lengths: np.ndarray | None,
        rng: np.random.Generator | None,
        batch_size: int,
        world_size: int,
        drop_last: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        if self.batching is None:
            bounds = fixed_bounds(len(order), batch_size * world_size, world_size, drop_last)
        else:
            order, bounds = self.batching.arrange(order, lengths, rng, batch_size, world_size, drop_last)
        batches = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        repeated = [batch for batch in batches for _ in range(self.times)]
        sizes = np.repeat(np.diff(bounds), self.times)
        return (np.concatenate(repeated) if repeated else order[:0],
                np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))

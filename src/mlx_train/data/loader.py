"""The DataLoader: order, sharding, resume, prefetch and collation of batches.

Sample order comes from ``np.random.default_rng([seed, epoch])``; batches are
*global* (``batch_size * world_size`` samples) and rank ``r`` takes the ``r``-th
contiguous slice, so order does not depend on the number of ranks. The position
(epoch, batches yielded) is part of the training state and is restored by
arithmetic on index lists, never by reading and discarding samples.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlx_train.errors import DataError, did_you_mean

from .batching import EpochPlan, fixed_layout, plan_epoch
from .collate import Batch, to_mx
from .prefetch import prefetch
from .sources import ArraySource, IterableSource, lengths_of, make_source
from .stream import StreamCursor
from .workers import WorkerPool, read_batch

__all__ = ["DataLoader"]

STATE_FORMAT = "mlx_train.DataLoader/1"
_OPTIONS = ("dataset", "batch_size", "shuffle", "num_workers", "drop_last", "seed", "collate_fn", "batching",
            "worker_type")
WORKER_TYPES = ("thread", "process")
_THREAD_MIN_BATCH_BYTES = 1 << 20  # arrays: smaller batches are gathered on the consumer thread


def _check_int(value: Any, name: str, minimum: int, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        low = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise DataError(f"{name} must be {low}, got {value!r}; pass e.g. {name}={example}")
    return int(value)


def _check_worker_type(value: Any, source: Any) -> str:
    if value not in WORKER_TYPES:
        raise DataError(f"worker_type must be one of {', '.join(map(repr, WORKER_TYPES))}, got {value!r}"
                        f"{did_you_mean(str(value), WORKER_TYPES)}")
    if value == "process" and isinstance(source, IterableSource):
        raise DataError(
            f"worker_type='process' needs random access to samples, but the dataset "
            f"({type(source.dataset).__name__}) is an iterable read in order; use worker_type='thread' (one "
            "reader thread), or a map-style dataset (__len__ and __getitem__)"
        )
    return str(value)


_planner: ThreadPoolExecutor | None = None


def _plan_ahead(*args: Any) -> Future[EpochPlan]:
    """``plan_epoch(*args)`` on one shared background thread: the next epoch's seeded order is drawn while
    the training thread waits for the device (a pure function of its arguments: the same order)."""
    global _planner
    if _planner is None:
        _planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx_train-plan")
    return _planner.submit(plan_epoch, *args)


def _index(plan: EpochPlan, k: int) -> np.ndarray | slice:
    """The sample indices of this rank's part of batch ``k``."""
    s, e = plan.starts[k], plan.stops[k]
    return plan.order[s:e] if plan.order is not None else slice(s, e)


class DataLoader:
    """Batches from arrays, a map-style dataset or an iterable, in a seeded, resumable order.

    Arrays (``(x, y)`` or a dict) of up to 256 MB are held as MLX arrays (made at the first batch;
    later changes to the NumPy arrays are not seen) and each batch is gathered from them by MLX, in the
    step's graph; larger ones are gathered with one fancy-index per array;
    map-style samples (tuples, dicts, token lists) are collated by
    ``collate_fn`` (default :func:`~mlx_train.data.default_collate`: stack, pad
    token sequences to a multiple of 32 with a mask). Batches reach the
    consumer as ``mx.array``. ``num_workers > 0`` reads and collates upcoming
    batches in the background, in order; arrays batches under 1 MiB are gathered
    on the consumer thread, where that is cheaper than a hand-off. Iterables are
    read in order (``shuffle`` does not apply). ``batching`` takes
    :class:`LengthBucketing` or :class:`TokenBudget`. Iterate one loop at a time.

    ``worker_type`` says what the ``num_workers`` workers are:

    - ``"thread"`` (default): threads in this process. Cheap to start and they
      share the dataset, so ``__getitem__`` must be safe to call from several
      threads. Enough when a sample is mostly numpy, file reads or a fast
      tokenizer, which release the GIL.
    - ``"process"``: worker processes, started (with ``spawn``) on the first
      epoch and kept for the next ones until :meth:`close`, for samples that do
      Python work (augmenting, tokenising in Python) and so hold the GIL. The
      dataset and ``collate_fn`` must be picklable (module-level classes and
      functions) and should return numpy arrays; a script must guard its entry
      point with ``if __name__ == "__main__":``. Batches, their order, sharding
      and resume are the same as with threads or no workers (see :mod:`.workers`).

    Example::

        loader = DataLoader((x, y), batch_size=32, shuffle=True, num_workers=2, seed=0)
        for xb, yb in loader:          # one epoch; the next loop runs the next epoch
            ...
        state = loader.state_dict()    # JSON-able; loader.load_state_dict(state) resumes here
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 32,
        shuffle: bool = True,
        num_workers: int = 4,
        drop_last: bool = False,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Batch] | None = None,
        batching: Any = None,
        worker_type: str = "thread",
    ) -> None:
        if isinstance(dataset, DataLoader):
            raise DataError("dataset is already a DataLoader; use loader.replace(...) to change its options")
        options = dict(dataset=dataset, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers,
                       drop_last=drop_last, seed=seed, collate_fn=collate_fn, batching=batching,
                       worker_type=worker_type)
        self._setup(make_source(dataset), options)

    def _setup(self, source: Any, options: dict[str, Any]) -> None:
        self._source = source
        self._dataset = options["dataset"]
        self._batch_size = _check_int(options["batch_size"], "batch_size", 1, "32")
        self._num_workers = _check_int(options["num_workers"], "num_workers", 0, "2")
        self._seed = _check_int(options["seed"], "seed", 0, "0")
        self._shuffle = bool(options["shuffle"])
        self._drop_last = bool(options["drop_last"])
        self._collate_fn: Callable[[list[Any]], Batch] | None = options["collate_fn"]
        self._batching = options["batching"]
        self._worker_type = _check_worker_type(options["worker_type"], source)
        if self._collate_fn is not None and not callable(self._collate_fn):
            raise DataError(f"collate_fn must be a function of a list of samples, got {self._collate_fn!r}")
        if self._batching is not None:
            if not (hasattr(self._batching, "arrange") and hasattr(self._batching, "describe")):
                raise DataError(
                    f"batching={self._batching!r} is not a batching strategy; use "
                    "LengthBucketing(...) or TokenBudget(max_tokens=...) from mlx_train.data"
                )
            if isinstance(source, IterableSource):
                raise DataError(
                    f"batching={type(self._batching).__name__} needs random access to samples, but the "
                    "dataset is an iterable without __len__/__getitem__; use a map-style dataset"
                )
        if source.num_samples == 0:
            raise DataError(
                f"dataset is empty (0 samples, {type(self._dataset).__name__}); check the file, "
                "split or filter that produced it"
            )
        self._rank, self._world_size = 0, 1
        self._epoch, self._position = 0, 0
        self._cursor = StreamCursor(source) if isinstance(source, IterableSource) else None
        self._plan_cache: tuple[tuple[Any, ...], EpochPlan] | None = None
        self._ahead: tuple[tuple[Any, ...], Future[EpochPlan]] | None = None  # the next epoch's plan, drawing
        self._pool: WorkerPool | None = None
        self._row_bytes: int | None = None  # bytes of one sample's arrays (an array source), once known

    # ---------------------------------------------------------------- properties
    @property
    def epoch(self) -> int:
        """The current epoch (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Global batches yielded so far in this epoch."""
        return self._position

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank."""
        return self._batch_size

    @property
    def rank(self) -> int:
        """This rank's index (see set_shard)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks (see set_shard)."""
        return self._world_size

    @property
    def num_workers(self) -> int:
        """Background workers, threads or processes (see worker_type; 0: synchronous)."""
        return self._num_workers

    @property
    def worker_type(self) -> str:
        """What the workers are: ``"thread"`` or ``"process"``."""
        return self._worker_type

    @property
    def shuffle(self) -> bool:
        """Whether each epoch's order is a seeded permutation."""
        return self._shuffle

    @property
    def drop_last(self) -> bool:
        """Whether a partial last batch is dropped."""
        return self._drop_last

    @property
    def seed(self) -> int:
        """The seed of the order (with the epoch)."""
        return self._seed

    @property
    def dataset(self) -> Any:
        """The dataset as given."""
        return self._dataset

    @property
    def batching(self) -> Any:
        """The batching strategy, or None for fixed-size batches."""
        return self._batching

    @property
    def collate_fn(self) -> Callable[[list[Any]], Batch] | None:
        """The collate function, or None for the default."""
        return self._collate_fn

    @property
    def num_samples(self) -> int | None:
        """The number of samples in the dataset (None for an iterable)."""
        return cast("int | None", self._source.num_samples)

    def __repr__(self) -> str:
        return (f"DataLoader({self._source.kind}, num_samples={self.num_samples}, "
                f"batch_size={self._batch_size}, "
                f"shard={self._rank}/{self._world_size}, epoch={self._epoch}, position={self._position})")

    # ---------------------------------------------------------------- order
    def _plan(self) -> EpochPlan:
        """This epoch's batches for this rank (computed once per epoch and geometry)."""
        key = (self._epoch, self._batch_size, self._rank, self._world_size, self._drop_last)
        if self._plan_cache is None or self._plan_cache[0] != key:
            ahead, self._ahead = self._ahead, None
            geometry = (self._batch_size, self._rank, self._world_size, self._drop_last)
            if ahead is not None and ahead[0] == key:
                plan = ahead[1].result()
            else:
                lengths = None
                if self._batching is not None:
                    lengths = lengths_of(self._source, getattr(self._batching, "lengths", None))
                plan = plan_epoch(self._source.num_samples, self._seed, self._epoch, self._shuffle,
                                  geometry, self._batching, lengths)
            self._plan_cache = (key, plan)
            if self._shuffle and self._batching is None and self._num_workers > 0:
                # Fixed-size batches, background work allowed: the next epoch's order is drawn meanwhile.
                self._ahead = ((self._epoch + 1, *key[1:]), _plan_ahead(
                    self._source.num_samples, self._seed, self._epoch + 1, True, geometry))
        return self._plan_cache[1]

    def _checked_plan(self) -> EpochPlan:
        plan = self._plan()
        self._check_batches(plan.num_batches)
        return plan

    def _check_batches(self, num_batches: int) -> None:
        if num_batches == 0:
            raise DataError(
                f"the loader produces no batches: the dataset has {self.num_samples} samples, fewer than "
                f"one global batch of {self._batch_size * self._world_size} (batch_size {self._batch_size} x "
                f"world_size {self._world_size}) with drop_last={self._drop_last}; lower batch_size or set "
                "drop_last=False"
            )

    def arrays(self) -> tuple[Any, ...] | dict[str, Any] | None:
        """The dataset's arrays (numpy, all samples) when it is array-backed, else None: lets a caller check
        the whole dataset once instead of every batch."""
        source = self._source
        if not isinstance(source, ArraySource):
            return None
        return tuple(source.arrays) if source.keys is None else dict(zip(source.keys, source.arrays, strict=False))

    def __len__(self) -> int:
        """Batches per epoch (global batches; each rank yields this many)."""
        if isinstance(self._source, IterableSource):
            raise TypeError("a DataLoader over an iterable (streaming) dataset has no length")
        if self._batching is None:  # fixed-size batches: the count needs no order
            starts = fixed_layout(self._source.num_samples, self._batch_size, self._rank, self._world_size,
                                  self._drop_last)[1]
            self._check_batches(len(starts))
            return len(starts)
        return self._checked_plan().num_batches

    def _offset_now(self) -> int:
        """Global samples consumed in this epoch."""
        if self._cursor is not None or self._position == 0:
            return self._cursor.offset if self._cursor is not None else 0
        bounds = self._plan().bounds
        return int(bounds[min(self._position, len(bounds) - 1)])

    def _locate(self, offset: int, why: str) -> int:
        """The batch position that starts at sample ``offset`` of this epoch (by arithmetic)."""
        if offset == 0:
            return 0
        bounds = self._plan().bounds
        k = int(np.searchsorted(bounds, offset))
        if k >= len(bounds):
            return len(bounds) - 1
        if bounds[k] != offset:
            raise DataError(
                f"cannot {why}: {offset} samples of epoch {self._epoch} were consumed, which is not a batch "
                f"boundary with global batch {self._batch_size * self._world_size} (batch_size "
                f"{self._batch_size} x world_size {self._world_size}); choose a global batch size that "
                f"divides {offset}, or call set_epoch({self._epoch + 1}) to start at the next epoch"
            )
        return k

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Batch]:
        """Yield the rest of the current epoch's batches, then move to the next epoch."""
        if isinstance(self._source, IterableSource):
            yield from self._iter_stream()
            return
        plan = self._checked_plan()
        start, stop = self._position, plan.num_batches
        source = self._source
        if isinstance(source, ArraySource) and self._collate_fn is None and not self._threads_help():
            # The hot path (digits-sized arrays). Arrays MLX holds (``ArraySource.resident``) are gathered by
            # MLX in the step's graph, with the epoch's order converted once; larger ones with one NumPy
            # fancy-index and one copy into MLX per array, on this thread.
            keys, starts, stops = source.keys, plan.starts, plan.stops
            order: Any = plan.order
            arrays: list[Any] | None = source.resident()
            if arrays is not None and order is not None:
                order = mx.array(order, dtype=mx.int32)  # (resident arrays have fewer than 2**31 rows)
            batch: Batch
            for k in range(start, stop):
                index = order[starts[k]:stops[k]] if order is not None else slice(starts[k], stops[k])
                parts = ([a[index] for a in arrays] if arrays is not None else
                         [mx.array(a[index]) for a in source.arrays])
                batch = tuple(parts) if keys is None else dict(zip(keys, parts, strict=True))
                self._position = k + 1  # advances when a batch is yielded, not when it is prefetched
                yield batch
        else:
            batches: Generator[Batch, None, None]
            if self._num_workers == 0:
                batches = (to_mx(self._collate(plan, k)) for k in range(start, stop))
            elif self._worker_type == "process":
                batches = self._worker_pool().batches(lambda task: _index(plan, start + task), stop - start, to_mx)
            else:
                batches = self._prefetched(plan, start, stop)
            try:
                for k, batch in enumerate(batches, start + 1):
                    self._position = k
                    yield batch
            finally:
                batches.close()
        self._epoch, self._position = self._epoch + 1, 0

    def _threads_help(self) -> bool:
        """Whether to gather arrays on worker threads: only when batches are big.

        A small gather (a few microseconds) costs less than handing a batch between
        threads, so digits-sized batches are gathered on the consumer thread.
        """
        if self._num_workers == 0:
            return False
        if self._row_bytes is None:  # the same arrays all along: measured once
            self._row_bytes = int(sum(a[:1].nbytes for a in self._source.arrays))
        return self._row_bytes * self._batch_size >= _THREAD_MIN_BATCH_BYTES

    def _collate(self, plan: EpochPlan, k: int) -> Batch:
        """Batch k as numpy arrays (runs on a worker thread when num_workers > 0)."""
        return read_batch(self._source, self._collate_fn, _index(plan, k))

    def _worker_pool(self) -> WorkerPool:
        """This loader's worker processes, started on first use and kept for the next epochs."""
        if self._pool is None or not self._pool.usable:
            self.close()
            self._pool = WorkerPool(self._source, self._collate_fn, self._num_workers)
            weakref.finalize(self, self._pool.close)
        return self._pool

    def close(self) -> None:
        """Stop the worker processes (``worker_type="process"``) now instead of when the loader is
        garbage-collected or Python exits; a later iteration starts new ones.

        Example: ``loader.close()``.
        """
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _prefetched(self, plan: EpochPlan, start: int, stop: int) -> Generator[Batch, None, None]:
        results = prefetch(lambda task: self._collate(plan, start + task), stop - start, self._num_workers)
        try:
            for batch in results:
                yield to_mx(batch)
        finally:
            results.close()

    def _iter_stream(self) -> Iterator[Batch]:
        """Consecutive items of an iterable, ``batch_size * world_size`` per global batch."""
        cursor: StreamCursor = self._cursor  # type: ignore[assignment]  # set for every iterable source
        geometry = (self._batch_size, self._rank, self._world_size, self._drop_last)
        for batch, count, state in cursor.batches(self._epoch, self._position, geometry, self._collate_fn,
                                                  self._num_workers):
            batch = to_mx(batch)
            self._position, cursor.offset, cursor.state = self._position + 1, cursor.offset + count, state
            yield batch
        self._epoch, self._position = self._epoch + 1, 0
        cursor.reset()

    # ---------------------------------------------------------------- state
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch."""
        self._epoch = _check_int(epoch, "epoch", 0, "0")
        self._position = 0
        if self._cursor is not None:
            self._cursor.reset()

    def set_shard(self, rank: int, world_size: int) -> None:
        """Make this loader yield rank ``rank``'s slice of each global batch of ``world_size`` slices.

        The position is kept in samples (an error says so when that is not a batch boundary).
        Example: ``loader.set_shard(group.rank(), group.size())``.
        """
        world_size = _check_int(world_size, "world_size", 1, "2")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise DataError(
                f"rank must be an integer in [0, {world_size - 1}] for world_size {world_size}, got {rank!r}"
            )
        offset = self._offset_now()
        self._rank, self._world_size = int(rank), world_size
        if not isinstance(self._source, IterableSource):
            self._position = self._locate(offset, "change the number of ranks here")

    def state_dict(self) -> dict[str, Any]:
        """The loader's position and the options that define its order (JSON-able)."""
        state = {
            "format": STATE_FORMAT, "kind": self._source.kind, "epoch": self._epoch,
            "position": self._position, "sample_offset": self._offset_now(), "seed": self._seed,
            "shuffle": self._shuffle, "batch_size": self._batch_size, "world_size": self._world_size,
            "drop_last": self._drop_last, "num_samples": self.num_samples,
            "batching": self._batching.describe() if self._batching is not None else None,
        }
        if self._cursor is not None and self._cursor.state is not None:
            state["iterable_state"] = self._cursor.state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`) by arithmetic; nothing is read.

        The batch size and number of ranks may differ from the saved ones as long
        as the saved position is a batch boundary for the new global batch size.
        """
        missing = [k for k in ("format", "kind", "epoch", "position", "sample_offset", "seed", "shuffle",
                               "num_samples", "batching") if not isinstance(state, dict) or k not in state]
        if missing:
            raise DataError(
                f"data loader state is missing {missing}; pass the dict saved by DataLoader.state_dict()"
            )
        if state["kind"] != self._source.kind:
            raise DataError(f"the saved loader read a {state['kind']} dataset but this one reads a "
                            f"{self._source.kind} dataset; resume with the same kind of dataset")
        stream = isinstance(self._source, IterableSource)
        current = self.state_dict()
        for key in ("seed", "num_samples", "batching") + (() if stream else ("shuffle",)):
            if state[key] != current[key]:
                raise DataError(
                    f"the saved loader had {key}={state[key]!r} but this one has {key}={current[key]!r}, "
                    f"so the sample order differs and the position cannot be restored; create the "
                    f"DataLoader with the saved {key} (or start a fresh run)"
                )
        self._epoch = _check_int(state["epoch"], "epoch", 0, "0")
        offset = _check_int(state["sample_offset"], "sample_offset", 0, "0")
        if not stream:
            self._position = self._locate(offset, "resume here")
            return
        position = _check_int(state["position"], "position", 0, "0")
        if position > 0 and state.get("iterable_state") is None:
            raise DataError(
                f"cannot resume in the middle of epoch {self._epoch} (after {offset} items): the iterable "
                f"{type(self._source.dataset).__name__} has no state_dict()/load_state_dict() to restart "
                "there, and skipping items by reading them is not allowed; use a map-style dataset "
                "(__len__ and __getitem__), give the iterable state_dict/load_state_dict, or checkpoint "
                "only at epoch ends"
            )
        self._position = position
        self._cursor.reset()  # type: ignore[union-attr]  # an iterable source: the cursor is set
        self._cursor.offset, self._cursor.state = offset, state.get("iterable_state")  # type: ignore[union-attr]

    def replace(self, **changes: Any) -> DataLoader:
        """A new loader with the same dataset and options except ``changes``, at the same place.

        Epoch, shard and position carry over; the position is kept in samples, so
        it must be a batch boundary of the new loader (always true at an epoch start).
        Example: ``step_loader = loader.replace(batch_size=32 * 4)``.
        """
        for name in changes:
            if name not in _OPTIONS:
                raise DataError(f"replace() got an unknown option '{name}'{did_you_mean(name, _OPTIONS)}; "
                                f"options: {', '.join(_OPTIONS)}")
        options = dict(dataset=self._dataset, batch_size=self._batch_size, shuffle=self._shuffle,
                       num_workers=self._num_workers, drop_last=self._drop_last, seed=self._seed,
                       collate_fn=self._collate_fn, batching=self._batching, worker_type=self._worker_type)
        options.update(changes)
        new_data = "dataset" in changes and changes["dataset"] is not self._dataset
        new = DataLoader.__new__(DataLoader)
        new._setup(make_source(options["dataset"]) if new_data else self._source, options)
        new._rank, new._world_size, new._epoch = self._rank, self._world_size, self._epoch
        if new_data:
            return new
        if isinstance(self._source, IterableSource):
            new._position, new._cursor = self._position, self._cursor.copy()  # type: ignore[union-attr]  # iterable
        else:
            new._position = new._locate(self._offset_now(), "keep the position in replace()")
        return new


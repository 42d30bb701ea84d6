"""Reading an iterable (streaming) dataset: consecutive items, one global batch at a time.

Every rank reads every item and keeps its contiguous slice of each global
batch. A position inside an epoch can be restored only through the dataset's
own ``state_dict()`` / ``load_state_dict()`` (the state describes the next item
``iter()`` will produce), or by continuing the live iterator when no items
were read ahead; never by reading and discarding items.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Iterator
from typing import Any

from mlx_train.errors import DataError

from .collate import Batch, pad_collate
from .prefetch import prefetch
from .sources import IterableSource

__all__ = ["StreamCursor"]


class StreamCursor:
    """Where an iterable dataset is in its epoch: items consumed, its state, the live iterator."""

    def __init__(self, source: IterableSource) -> None:
        self.source = source
        self.reset()

    def reset(self) -> None:
        self.offset = 0  # items consumed this epoch (global)
        self.state: Any = None  # dataset.state_dict() after the last yielded batch
        self.live: Iterator[Any] | None = None  # this epoch's iterator, while no item was read ahead

    def copy(self) -> StreamCursor:
        twin = StreamCursor(self.source)
        twin.offset, twin.state, twin.live = self.offset, self.state, self.live
        return twin

    def _open(self, epoch: int, position: int) -> Iterator[Any]:
        """The iterator to read from: fresh, restored from the saved state, or the live one."""
        source = self.source
        if position == 0:
            self.live = source.open()
        elif source.stateful and self.state is not None:
            source.dataset.load_state_dict(self.state)
            self.live = source.open()
        elif self.live is None:
            raise DataError(
                f"cannot continue epoch {epoch} after {self.offset} items: the iterable "
                f"{type(source.dataset).__name__} has no state_dict()/load_state_dict() to restart there "
                "(and batches read ahead by workers were dropped), and skipping items by reading them is "
                "not allowed; use a map-style dataset (__len__ and __getitem__), give the iterable "
                "state_dict/load_state_dict, use num_workers=0, or stop only at epoch ends"
            )
        return self.live

    def batches(
        self,
        epoch: int,
        position: int,
        geometry: tuple[int, int, int, bool],
        collate_fn: Callable[[list[Any]], Batch] | None,
        num_workers: int,
    ) -> Iterator[tuple[Batch, int, Any]]:
        """Yield ``(numpy batch for this rank, items in the global batch, dataset state after it)``."""
        batch_size, rank, world, drop_last = geometry
        size, source = batch_size * world, self.source
        stream, read = self._open(epoch, position), [0]

        def produce(_: int) -> tuple[Any, ...]:
            items = list(itertools.islice(stream, size))
            read[0] += len(items)
            if not items or len(items) < world or (len(items) < size and drop_last):
                raise StopIteration
            share, extra = divmod(len(items), world)
            lo = rank * share + min(rank, extra)
            mine = items[lo : lo + share + (rank < extra)]
            first = self.offset + read[0] - len(items) + lo
            where = range(first, first + len(mine))
            batch = collate_fn(mine) if collate_fn else pad_collate(mine, indices=where)
            return batch, len(items), source.dataset.state_dict() if source.stateful else None

        results = _until_stop(produce) if num_workers == 0 else prefetch(produce, None, 1)
        yielded = 0
        try:
            for result in results:
                yielded += 1
                yield result
        finally:
            results.close()
            if num_workers > 0:
                self.live = None  # items read ahead are gone; only a stateful stream can continue
        if yielded == 0 and position == 0:
            name = type(source.dataset).__name__
            if read[0] == 0 and epoch > 0 and source.one_shot:
                raise DataError(
                    f"the dataset ({name}) is a one-shot iterator, exhausted after the first epoch; pass "
                    "a re-iterable object (a list, or a class whose __iter__ starts over) or a map-style "
                    "dataset"
                )
            if read[0] == 0:
                raise DataError(f"dataset is empty: iterating {name} gave no items")
            raise DataError(
                f"the stream gave {read[0]} items, fewer than one global batch of {size} with "
                f"drop_last={drop_last}; lower batch_size or set drop_last=False"
            )


def _until_stop(produce: Callable[[int], Any]) -> Generator[Any, None, None]:
    """``produce(0), produce(1), ...`` until it raises StopIteration (synchronous streams)."""
    for task in itertools.count():
        try:
            result = produce(task)
        except StopIteration:
            return
        yield result

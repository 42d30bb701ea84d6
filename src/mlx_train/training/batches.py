"""The loop's one view of its training batches: a DataLoader, or any iterable the user passes.

A DataLoader knows its epoch, its position in it, its length, and can be sharded and replayed; a plain
iterable gives one optimizer step per item and its epochs are counted by the loop state. ``Batches``
answers the same questions for both, so the loop asks without testing which it has.

Example::

    batches = Batches(loader)
    batches.shard(rank, world_size)
    for batch in batches: ...
    batches.finished_epoch(state.epoch)      # True/False for a DataLoader, None for a plain iterable
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from mlx_train.data import DataLoader
from mlx_train.training.schedule import at_epoch_end, length_of


class Batches:
    """``source`` (a DataLoader, any iterable of batches, or None) as the loop sees it."""

    def __init__(self, source: Iterable[Any] | None) -> None:
        self.source = source
        self.loader = source if isinstance(source, DataLoader) else None

    def __iter__(self) -> Iterator[Any]:
        return iter(self.source or ())

    def epoch(self, state: Any) -> int:
        """The epoch to train next: the loader's, or for a plain iterable the loop state's."""
        return int(self.source.epoch) if hasattr(self.source, "epoch") else int(state.next_epoch)  # type: ignore[union-attr]

    @property
    def position(self) -> int:
        """Batches of the current epoch handed out (0 for a plain iterable)."""
        return self.loader.position if self.loader is not None else 0

    @property
    def length(self) -> int | None:
        """Batches per epoch of a DataLoader (None for a stream or a plain iterable)."""
        return length_of(self.loader) if self.loader is not None else None

    def shard(self, rank: int, size: int) -> None:
        """Take rank ``rank``'s slice of every global batch (a plain iterable is the user's to shard)."""
        if self.loader is not None and self.loader.world_size != size:
            self.loader.set_shard(rank, size)

    def finished_epoch(self, epoch: int) -> bool | None:
        """Whether the loader has moved past ``epoch`` (None for a plain iterable, which cannot tell)."""
        loader = self.loader
        if loader is None:
            return None
        if loader.epoch == epoch and at_epoch_end(loader):  # (the epoch's length only when needed)
            loader.set_epoch(epoch + 1)  # stopped right on the last batch: the epoch is done
        return loader.epoch > epoch

    def replay(self, epoch: int) -> DataLoader | None:
        """A copy of the loader at the start of ``epoch`` (the loader is not moved), or None."""
        if self.loader is None or self.loader.num_samples is None:
            return None
        replay = self.loader.replace(num_workers=0)
        replay.set_epoch(epoch)
        return replay

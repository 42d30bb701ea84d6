"""The collectives of a training run, made through one seam that can list them.

Every layer ``distributed.tensor.shard_model`` leaves in a model (MLX's sharded linears become the
``Tracked*`` layers of ``distributed.tensor.layers``, which compute exactly what MLX's do), the split
vocabulary, the sharded adapters of ``llm.adapters``, the loss over a split vocabulary (``llm.loss``), the
step's reduction, and whatever else of the library communicates in a run (the memory guard's votes, report
sums, barriers, checksums) make their collectives with these functions: ``mx.distributed``'s own, recorded
while ``recording_collectives`` is active in the calling context (a context variable; nothing of MLX is
replaced). Building a step's value and gradient inside the block -- lazily, never evaluated -- lists every
collective it makes, in call order, with the shape and dtype of what it moves: a backward-pass collective is
made when the gradient graph is built (``sum_gradients``' VJP runs then); a compiled step lists its own when it
is traced. Not listed: collectives a model's own code makes with ``mx.distributed`` directly
(``distributed.tensor.untracked_modules`` names split layers of other types), and those of MLX's own functions
(``nn.average_gradients``, which data parallelism uses for gradients over 32 MB, and FSDP's ``fully_shard``).

Example::

    with recording_collectives() as seen:       # [Collective("all_sum", (8, 64, 576), float32), ...]
        mx.value_and_grad(loss)(params)
    sum(c.nbytes for c in seen)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import mlx.core as mx

__all__ = ["Collective", "Tracked", "recording_collectives", "all_sum", "all_max", "all_gather", "sum_gradients"]


class Tracked:
    """Marker of a module whose collectives all go through this module (so a step's list is complete): the
    tracked linears and the split vocabulary of ``layers``, the sharded adapters of ``llm.adapters``."""


@dataclass(frozen=True)
class Collective:
    """One collective call: the operation and the shape and dtype of the array it is given.

    Example: ``Collective("all_sum", (8, 64, 576), mx.float32).nbytes  # 1179648``
    """

    op: str
    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        """The bytes of the array given to the collective (what each rank contributes)."""
        return math.prod(self.shape) * self.dtype.size


_SEEN: ContextVar[list[Collective] | None] = ContextVar("mlx_train_collectives", default=None)


@contextmanager
def recording_collectives() -> Iterator[list[Collective]]:
    """List every collective made through this module in the block (in this context), in call order; the
    calls still happen. Nested blocks each get their own list.

    Example::

        with recording_collectives() as seen:
            all_sum(mx.ones((3, 5)), group=group)
        seen  # [Collective("all_sum", (3, 5), mx.float32)]
    """
    seen: list[Collective] = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def _note(op: str, x: mx.array) -> None:
    seen = _SEEN.get()
    if seen is not None:
        seen.append(Collective(op, tuple(x.shape), x.dtype))


def all_sum(x: mx.array, *, group: Any = None, stream: Any = None) -> mx.array:
    """``mx.distributed.all_sum``, listed while recording."""
    _note("all_sum", x)
    return mx.distributed.all_sum(x, group=group, stream=stream)


def all_max(x: mx.array, *, group: Any = None, stream: Any = None) -> mx.array:
    """``mx.distributed.all_max``, listed while recording."""
    _note("all_max", x)
    return mx.distributed.all_max(x, group=group, stream=stream)


def all_gather(x: mx.array, *, group: Any = None, stream: Any = None) -> mx.array:
    """``mx.distributed.all_gather``, listed while recording."""
    _note("all_gather", x)
    return mx.distributed.all_gather(x, group=group, stream=stream)


@lru_cache
def sum_gradients(group: Any) -> Callable[[mx.array], mx.array]:
    """The identity, whose gradient is summed over ``group`` (``all_sum``, listed while recording): what
    ``mlx.nn.layers.distributed.sum_gradients`` computes.

    Example: ``x = sum_gradients(group)(x)  # before a layer whose output is split``
    """
    if group.size() == 1:
        return lambda x: x

    @mx.custom_function
    def identity(x: mx.array) -> mx.array:
        return x

    @identity.vjp
    def summed(x: mx.array, dx: mx.array, _: mx.array) -> mx.array:
        return all_sum(dx, group=group)

    return cast(Callable[[mx.array], mx.array], identity)

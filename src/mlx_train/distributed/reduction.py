"""The gradient reductions a distributed step is built with (``Reduction``), one per topology.

``fused_average`` (data parallel) sums gradients, item counts and the ranks' votes (``Votes``: stop, out of
memory, check after the update) in one all-reduce; ``sharded_reduction`` (FSDP) only sums item counts and
norms. The step builder (``mlx_train.training.step``) applies a ``Reduction`` inside the compiled update.

Example::

    reduction = fused_average(group)
    step = build_step(model, optimizer, Loss(), StepOptions(), state.loss_scale, reduction)
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_train.distributed import collectives

__all__ = ["FUSE_BYTES", "Reduction", "Votes", "fused_average", "sharded_reduction"]

FUSE_BYTES = 32 * 2**20  # nn.average_gradients' bucket size: larger gradients keep its bucketing

#: The largest integer each floating dtype holds exactly (what a sum of votes may reach).
_EXACT = {mx.float32: 2**24, mx.float16: 2**11, mx.bfloat16: 2**8}


class Votes:
    """Flags that every rank casts before a step and that the step's all-reduce sums over the ranks.

    The flags (``names``) travel as the digits of ONE number in base ``world + 1`` (a digit sums at most
    ``world`` ones), ``state["stop"]``: whatever their number, the all-reduce carries one value more, and its
    lowest digit is the stop vote. ``cast`` sets this rank's flags before a step; after it ``summed()`` says
    how many ranks raised each: one host read per step (``reads`` counts them), of a value that the step's
    own evaluation has already produced, so it does not wait.

    Example::

        votes = Votes(world=2, names=("stop", "out_of_memory"))
        votes.cast(stop=True)                   # this rank, before the step
        ...                                     # the step's all-reduce sums votes.state["stop"]
        votes.summed()                          # {"stop": 1, "out_of_memory": 0}
    """

    def __init__(self, world: int, names: tuple[str, ...] = ("stop",)) -> None:
        self.names, self.base = names, world + 1
        self.mine = dict.fromkeys(names, False)
        #: Captured with the step's state: the vote word this rank casts, and after the step the ranks' sum.
        self.state: dict[str, mx.array] = {"stop": mx.array(0.0)}
        #: Host reads of the summed votes (one per step that ``summed`` is asked about).
        self.reads = 0
        self._words: dict[int, mx.array] = {}
        self._read: tuple[mx.array | None, dict[str, int]] = (None, {})

    def cast(self, **flags: bool) -> None:
        """Set this rank's ``flags`` (by name; the others keep their value) for the next step."""
        self.mine.update(flags)
        word = sum(self.base**i for i, name in enumerate(self.names) if self.mine[name])
        if word not in self._words:  # one array per word: no new array each step
            self._words[word] = mx.array(float(word))
        self.state["stop"] = self._words[word]

    def reset(self) -> None:
        """No flag raised: a new run does not inherit the votes of the last one."""
        self.cast(**dict.fromkeys(self.names, False))

    def summed(self) -> dict[str, int]:
        """How many ranks raised each flag in the last step's all-reduce (read once per step)."""
        word = self.state["stop"]
        if word is not self._read[0]:
            self.reads += 1
            value, counts = int(word.item()), {}  # type: ignore[arg-type]  # a float32 scalar
            for name in self.names:
                value, counts[name] = divmod(value, self.base)
            self._read = (word, counts)
        return self._read[1]

    def fits(self, dtype: mx.Dtype) -> bool:
        """Whether an all-reduce in ``dtype`` sums the vote word exactly."""
        return bool(self.base ** len(self.names) <= _EXACT.get(dtype, 0))


@dataclass(frozen=True)
class Reduction:
    """How gradients are combined across processes (inside the compiled update).

    ``reduce(grads, n_items) -> (grads, n_items)`` averages gradients and the item counts that
    weight them; ``clip(grads, max_norm) -> (grads, norm)`` replaces the global-norm clip (sharded
    models); ``before_update()`` runs in Python before the update is dispatched (a watchdog);
    ``votes`` are the ranks' flags that ``reduce`` sums with the gradients (``state``: their arrays,
    captured with the step's state).
    """

    reduce: Callable[[Any, mx.array | None], tuple[Any, mx.array | None]]
    clip: Callable[[Any, float | None], tuple[Any, mx.array | None]] | None = None
    before_update: Callable[[], None] | None = None
    votes: Votes | None = None

    @property
    def state(self) -> dict[str, mx.array] | None:
        """The arrays ``reduce`` reads and writes (the vote word), captured with the step's state."""
        return self.votes.state if self.votes is not None else None


def fused_average(group: Any, before_update: Callable[[], None] | None = None) -> Reduction:
    """Data-parallel reduction: gradients up to ``FUSE_BYTES``, their item count and the ranks' votes
    summed in ONE all-reduce (the ring's latency, not its bandwidth, bounds small models: a collective of its
    own for a vote made a small step up to 3x slower); larger gradients use ``nn.average_gradients``' buckets.

    The votes (``Votes``): ``stop`` (a stop signal arrived), ``out_of_memory`` (this rank's step failed
    before its all-reduce, which it then joins with zero gradients: ``TrainStep.stand_in``) and
    ``check_after`` (this rank asks that the ranks compare after the update whether one ran out of memory or
    over its budget there, the memory guard's check; see ``training.oom``).
    """
    world = group.size()
    votes = Votes(world, ("stop", "out_of_memory", "check_after"))

    def reduce(grads: Any, n_items: mx.array | None) -> tuple[Any, mx.array | None]:
        flat = tree_flatten(grads)
        dtypes = {g.dtype for _, g in flat}
        word = votes.state["stop"]
        if n_items is None or len(dtypes) != 1 or not votes.fits(next(iter(dtypes))) or \
                sum(g.nbytes for _, g in flat) > FUSE_BYTES:
            grads = nn.average_gradients(grads, group=group)
            counts = mx.stack([word] + ([] if n_items is None else [n_items.astype(mx.float32)]))
            counts = collectives.all_sum(counts, group=group)
            votes.state["stop"] = counts[0]
            return grads, None if n_items is None else (counts[1] / world).astype(n_items.dtype)
        dtype = dtypes.pop()
        tail = [n_items.reshape(1).astype(dtype), word.reshape(1).astype(dtype)]
        joined = collectives.all_sum(mx.concatenate([g.reshape(-1) for _, g in flat] + tail), group=group)
        parts = mx.split(joined, list(itertools.accumulate(g.size for _, g in flat)))
        averaged = [(k, (part / world).reshape(g.shape)) for (k, g), part in zip(flat, parts, strict=False)]
        votes.state["stop"] = parts[-1][1].astype(mx.float32)
        return tree_unflatten(averaged), (parts[-1][0] / world).astype(n_items.dtype)

    return Reduction(reduce, before_update=before_update, votes=votes)


def sharded_reduction(group: Any, before_update: Callable[[], None] | None = None) -> Reduction:
    """FSDP: ``nn.fully_shard`` already reduce-scatters (and averages) each rank's gradient shard; only
    the item count is summed, and clipping uses the norm over all shards."""
    world = group.size()

    def reduce(grads: Any, n_items: mx.array | None) -> tuple[Any, mx.array | None]:
        if n_items is not None:
            n_items = collectives.all_sum(n_items, group=group) / world
        return grads, n_items

    def clip(grads: Any, max_norm: float | None) -> tuple[Any, mx.array | None]:
        if max_norm is not None:
            clipped: tuple[Any, mx.array] = nn.utils.clip_grad_norm_sharded(grads, max_norm, group=group)
            return clipped
        squares = functools.reduce(mx.add, [mx.sum(mx.square(g)) for _, g in tree_flatten(grads)])
        return grads, mx.sqrt(collectives.all_sum(squares, group=group))

    return Reduction(reduce, clip, before_update)

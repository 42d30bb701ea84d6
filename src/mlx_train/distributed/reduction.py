"""The gradient reductions a distributed step is built with (``Reduction``), one per topology.

``fused_average`` (data parallel) sums gradients, item counts and the ranks' votes in one all-reduce;
``sharded_reduction`` (FSDP) only sums item counts and norms. The step builder
(``mlx_train.training.step``) applies a ``Reduction`` inside the compiled update.

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

__all__ = ["FUSE_BYTES", "Reduction", "fused_average", "sharded_reduction"]

FUSE_BYTES = 32 * 2**20  # nn.average_gradients' bucket size: larger gradients keep its bucketing


@dataclass(frozen=True)
class Reduction:
    """How gradients are combined across processes (inside the compiled update).

    ``reduce(grads, n_items) -> (grads, n_items)`` averages gradients and the item counts that
    weight them; ``clip(grads, max_norm) -> (grads, norm)`` replaces the global-norm clip (sharded
    models); ``before_update()`` runs in Python before the update is dispatched (a watchdog);
    ``state`` holds arrays that ``reduce`` reads and writes, captured with the step's state (the
    ranks' stop vote, summed with the gradients).
    """

    reduce: Callable[[Any, mx.array | None], tuple[Any, mx.array | None]]
    clip: Callable[[Any, float | None], tuple[Any, mx.array | None]] | None = None
    before_update: Callable[[], None] | None = None
    state: dict[str, mx.array] | None = None


def fused_average(group: Any, before_update: Callable[[], None] | None = None) -> Reduction:
    """Data-parallel reduction: gradients up to ``FUSE_BYTES``, their item count and the ranks' stop
    vote summed in ONE all-reduce (the ring's latency, not its bandwidth, bounds small models: a
    collective of its own for the vote made a small step up to 3x slower); larger gradients use
    ``nn.average_gradients``' buckets.

    The vote is ``reduction.state["stop"]``: each rank sets it to 1.0 (a stop signal arrived) or 0.0
    before a step, and reads after it how many ranks voted to stop.
    """
    world = group.size()
    votes = {"stop": mx.array(0.0)}

    def reduce(grads: Any, n_items: mx.array | None) -> tuple[Any, mx.array | None]:
        flat = tree_flatten(grads)
        dtypes = {g.dtype for _, g in flat}
        if n_items is None or len(dtypes) != 1 or sum(g.nbytes for _, g in flat) > FUSE_BYTES:
            grads = nn.average_gradients(grads, group=group)
            counts = mx.stack([votes["stop"]] + ([] if n_items is None else [n_items.astype(mx.float32)]))
            counts = mx.distributed.all_sum(counts, group=group)
            votes["stop"] = counts[0]
            return grads, None if n_items is None else (counts[1] / world).astype(n_items.dtype)
        dtype = dtypes.pop()
        tail = [n_items.reshape(1).astype(dtype), votes["stop"].reshape(1).astype(dtype)]
        joined = mx.distributed.all_sum(mx.concatenate([g.reshape(-1) for _, g in flat] + tail), group=group)
        parts = mx.split(joined, list(itertools.accumulate(g.size for _, g in flat)))
        averaged = [(k, (part / world).reshape(g.shape)) for (k, g), part in zip(flat, parts, strict=False)]
        votes["stop"] = parts[-1][1].astype(mx.float32)
        return tree_unflatten(averaged), (parts[-1][0] / world).astype(n_items.dtype)

    return Reduction(reduce, before_update=before_update, state=votes)


def sharded_reduction(group: Any, before_update: Callable[[], None] | None = None) -> Reduction:
    """FSDP: ``nn.fully_shard`` already reduce-scatters (and averages) each rank's gradient shard; only
    the item count is summed, and clipping uses the norm over all shards."""
    world = group.size()

    def reduce(grads: Any, n_items: mx.array | None) -> tuple[Any, mx.array | None]:
        if n_items is not None:
            n_items = mx.distributed.all_sum(n_items, group=group) / world
        return grads, n_items

    def clip(grads: Any, max_norm: float | None) -> tuple[Any, mx.array | None]:
        if max_norm is not None:
            clipped: tuple[Any, mx.array] = nn.utils.clip_grad_norm_sharded(grads, max_norm, group=group)
            return clipped
        squares = functools.reduce(mx.add, [mx.sum(mx.square(g)) for _, g in tree_flatten(grads)])
        return grads, mx.sqrt(mx.distributed.all_sum(squares, group=group))

    return Reduction(reduce, clip, before_update)

"""The step's gradient reduction for tensor parallelism, and the check that replicated parameters agree.

No gradient is all-reduced: the sharded layers' gradients are each rank's slice of the full gradient
(``AllToShardedLinear`` and the split head all-reduce their input's gradient in the backward pass), and
everything replicated (norms, attention ``shard`` leaves whole, an unsplit embedding or head) is computed by
every rank on the same batch from the bit-identical outputs of the all-reduces, so its gradients agree across
ranks without communication (``replicated_agree`` checks it).

Example::

    reduction = tensor_parallel_reduction(group, layout)   # for build_step(..., reduction=...)
    assert not replicated_agree(model, layout, group)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from mlx_train.distributed import collectives
from mlx_train.distributed.reduction import Reduction, Votes
from mlx_train.distributed.tensor.layout import Layout

__all__ = ["tensor_parallel_reduction", "replicated_agree"]


def tensor_parallel_reduction(group: Any, layout: Layout, before_update: Callable[[], None] | None = None) -> Reduction:
    """The step's reduction for tensor parallelism: no gradient is all-reduced (each rank's slice is its
    shard's exact gradient, replicated parameters agree by construction); the ranks' stop vote is summed
    (one scalar), and clipping uses the norm of the whole gradient: the sharded parameters' squares
    summed over ranks plus the replicated ones' counted once.

    Example: ``build_step(model, optimizer, loss, options, scale, reduction=tensor_parallel_reduction(group, layout))``
    """
    votes = Votes(group.size())

    def reduce(grads: Any, n_items: mx.array | None) -> tuple[Any, mx.array | None]:
        votes.state["stop"] = collectives.all_sum(votes.state["stop"], group=group)
        return grads, n_items

    def clip(grads: Any, max_norm: float | None) -> tuple[Any, mx.array | None]:
        if max_norm is None:
            return grads, None
        flat = tree_flatten(grads)
        sharded = [mx.sum(mx.square(g)) for k, g in flat if k in layout]
        replicated = [mx.sum(mx.square(g)) for k, g in flat if k not in layout]
        squares = mx.array(0.0)
        if sharded:
            squares = collectives.all_sum(sum(sharded[1:], sharded[0]), group=group)
        if replicated:
            squares = squares + sum(replicated[1:], replicated[0])
        norm = mx.sqrt(squares)
        normalizer = mx.minimum(max_norm / (norm + 1e-6), 1.0)  # as optim.clip_grad_norm
        return tree_map_with_path(lambda _, g: g * normalizer, grads), norm

    return Reduction(reduce, clip, before_update, votes=votes)


def replicated_agree(model: nn.Module, layout: Layout, group: Any) -> list[str]:
    """The replicated parameters whose values differ between ranks (empty when all agree bit for bit).

    Example: ``assert not replicated_agree(model, layout, group)``
    """
    if group.size() == 1:
        return []
    differing = []
    for key, value in tree_flatten(model.parameters()):
        if key in layout:
            continue
        stacked = collectives.all_gather(value.reshape(1, -1), group=group, stream=mx.cpu)
        if not bool(mx.all(stacked == stacked[0:1]).item()):
            differing.append(key)
    return differing

"""Tensor parallelism on MLX's own sharded layers: every rank holds a slice of each large matrix.

- ``layout``: which parameters are split, on which axis, in which slices (``Split``), and moving whole
  parameters to slices and back (``take_shard``, ``gather_parameters``); the record checkpoints keep.
- ``layers``: ``shard_model`` (the model's own ``shard(group)``, attention split unevenly by key/value
  groups, the vocabulary split) and the layers it puts in (``VocabParallelEmbedding``, ``VocabParallelHead``
  -- both ``VocabularySlice``\\ s).
- ``linears``: MLX's sharded linears as ``Tracked*`` layers (every layer ``shard_model`` leaves makes its
  collectives through ``distributed.collectives``: ``time_comm`` counts them) and the uneven linears.
- ``checkpoints``: ``ShardedCheckpoints``, each rank's shard files, ``reshard`` on resume.
- ``reduction``: the step's ``tensor_parallel_reduction`` and ``replicated_agree``.

Every rank builds the same whole model (same weights file, or same seed) and takes its own slices; the
replicated parameters are then made rank 0's (``DistributedTrainer`` broadcasts them). A split cuts each
matrix into contiguous slices, equal ones unless the layout says otherwise: ``shard_linear(..., segments=k)``
(fused QKV) is not described by the layout, so checkpoints of such a model resume only on the same number of
ranks. Tensor x data parallelism is not supported: the whole group is one tensor-parallel group. Fine-tuning
on a split model (adapters on the split layers, written whole) is ``mlx_train.llm.tensor_parallel``.

Example::

    from mlx_train.distributed.tensor import gather_parameters, shard_model
    layout = shard_model(model, mx.distributed.init())
    full = gather_parameters(dict(tree_flatten(model.parameters())), layout, group)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

if TYPE_CHECKING:
    from mlx_train.distributed.tensor.checkpoints import (
        SHARDS_DIR,
        ShardedCheckpoints,
        prune_shards,
        read_shard,
        reshard,
        shard_path,
        write_shard,
    )
    from mlx_train.distributed.tensor.layers import (
        Shardable,
        VocabParallelEmbedding,
        VocabParallelHead,
        VocabularySlice,
        group_counts,
        materialize,
        shard_model,
        shard_vocabulary,
    )
    from mlx_train.distributed.tensor.layout import (
        Layout,
        Split,
        gather_parameters,
        is_sharded,
        layout_from_record,
        layout_record,
        optimizer_layout,
        shard_layout,
        split_sizes,
        take_shard,
    )
    from mlx_train.distributed.tensor.linears import (
        UnevenAllToShardedLinear,
        UnevenShardedToAllLinear,
        track_collectives,
        untracked_modules,
    )
    from mlx_train.distributed.tensor.reduction import replicated_agree, tensor_parallel_reduction

_LAZY = {
    "SHARDS_DIR": "mlx_train.distributed.tensor.checkpoints",
    "ShardedCheckpoints": "mlx_train.distributed.tensor.checkpoints",
    "prune_shards": "mlx_train.distributed.tensor.checkpoints",
    "read_shard": "mlx_train.distributed.tensor.checkpoints",
    "reshard": "mlx_train.distributed.tensor.checkpoints",
    "shard_path": "mlx_train.distributed.tensor.checkpoints",
    "write_shard": "mlx_train.distributed.tensor.checkpoints",
    "Shardable": "mlx_train.distributed.tensor.layers",
    "VocabParallelEmbedding": "mlx_train.distributed.tensor.layers",
    "VocabParallelHead": "mlx_train.distributed.tensor.layers",
    "VocabularySlice": "mlx_train.distributed.tensor.layers",
    "group_counts": "mlx_train.distributed.tensor.layers",
    "materialize": "mlx_train.distributed.tensor.layers",
    "shard_model": "mlx_train.distributed.tensor.layers",
    "shard_vocabulary": "mlx_train.distributed.tensor.layers",
    "UnevenAllToShardedLinear": "mlx_train.distributed.tensor.linears",
    "UnevenShardedToAllLinear": "mlx_train.distributed.tensor.linears",
    "track_collectives": "mlx_train.distributed.tensor.linears",
    "untracked_modules": "mlx_train.distributed.tensor.linears",
    "Layout": "mlx_train.distributed.tensor.layout",
    "Split": "mlx_train.distributed.tensor.layout",
    "gather_parameters": "mlx_train.distributed.tensor.layout",
    "is_sharded": "mlx_train.distributed.tensor.layout",
    "layout_from_record": "mlx_train.distributed.tensor.layout",
    "layout_record": "mlx_train.distributed.tensor.layout",
    "optimizer_layout": "mlx_train.distributed.tensor.layout",
    "shard_layout": "mlx_train.distributed.tensor.layout",
    "split_sizes": "mlx_train.distributed.tensor.layout",
    "take_shard": "mlx_train.distributed.tensor.layout",
    "replicated_agree": "mlx_train.distributed.tensor.reduction",
    "tensor_parallel_reduction": "mlx_train.distributed.tensor.reduction",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["Layout", "SHARDS_DIR", "Shardable", "ShardedCheckpoints", "Split", "UnevenAllToShardedLinear",
           "UnevenShardedToAllLinear", "VocabParallelEmbedding", "VocabParallelHead", "VocabularySlice",
           "gather_parameters", "group_counts", "is_sharded", "layout_from_record", "layout_record",
           "materialize", "optimizer_layout", "prune_shards", "read_shard", "replicated_agree", "reshard",
           "shard_layout", "shard_model", "shard_path", "shard_vocabulary", "split_sizes", "take_shard",
           "tensor_parallel_reduction", "track_collectives", "untracked_modules", "write_shard"]

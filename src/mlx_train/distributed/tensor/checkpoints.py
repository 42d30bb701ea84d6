"""Checkpoints of a tensor-parallel run: each rank's slices, the layout, and re-sharding on resume.

Rank 0's checkpoint (``step-N``, written by the CheckpointManager as in any run) holds the loop state,
rank 0's slices and, under ``"tensor_parallel"`` in its JSON, the world size and the layout
(``layout.layout_record``). Every other rank writes its slices to
``<checkpoint_dir>/tp-shards/step-N/rank-<r>.safetensors`` (``model.*`` and ``optimizer.*``) before rank 0
starts its save, so a complete ``step-N`` always has its shards. A checkpoint with another layout or world
size (or a whole one) is re-sharded (``reshard``).

Example::

    write_shard(checkpoint_dir, step, rank, model_slices, optimizer_slices)   # ranks >= 1
    arrays = reshard(checkpoint, arrays, saved_state, layout, rank, size)      # on resume
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import mlx.core as mx

from mlx_train.checkpointing.format import STEP_DIR, step_name
from mlx_train.checkpointing.manager import CheckpointManager
from mlx_train.distributed.tensor.layout import (
    Layout,
    axis_of,
    layout_from_record,
    layout_record,
    optimizer_layout,
    same_layout,
    take_shard,
)
from mlx_train.errors import CheckpointError

__all__ = ["SHARDS_DIR", "ShardedCheckpoints", "shard_path", "write_shard", "read_shard", "prune_shards", "reshard"]

SHARDS_DIR = "tp-shards"


class ShardedCheckpoints(CheckpointManager):
    """A CheckpointManager whose checkpoints record the tensor-parallel layout (``record``: the world size
    and the layout, ``{"world_size": 2, "layout": {path: entry}}``).

    Example: ``ShardedCheckpoints("runs/a/checkpoints", {"world_size": 2, "layout": layout}, keep_last=3)``
    """

    def __init__(self, directory: str, record: dict[str, Any], **options: Any) -> None:
        super().__init__(directory, **options)
        self.record = record

    def save(self, step: int, arrays: dict[str, dict[str, mx.array]], state: dict[str, Any],
             metrics: dict[str, Any] | None = None) -> str:
        record = {**self.record, **layout_record(self.record.get("layout", {}))}  # the sizes of uneven splits
        return super().save(step, arrays, {**state, "tensor_parallel": record}, metrics)


def shard_path(directory: str, step: int, rank: int) -> str:
    """Where rank ``rank`` (>= 1) keeps its slices of the checkpoint of ``step``."""
    return os.path.join(directory, SHARDS_DIR, step_name(step), f"rank-{rank}.safetensors")


def write_shard(directory: str, step: int, rank: int, model: dict[str, mx.array],
                optimizer: dict[str, mx.array]) -> str:
    """Write one rank's slices atomically (a temporary file renamed into place); returns the path."""
    path = shard_path(directory, step, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.safetensors"
    flat = {**{"model." + k: v for k, v in model.items()}, **{"optimizer." + k: v for k, v in optimizer.items()}}
    mx.save_safetensors(tmp, flat, metadata={"step": str(step), "rank": str(rank)})
    os.replace(tmp, path)
    return path


def read_shard(checkpoint: str, step: int, rank: int) -> dict[str, dict[str, mx.array]]:
    """``{"model": ..., "optimizer": ...}`` of rank ``rank`` for the checkpoint at ``checkpoint``."""
    path = shard_path(os.path.dirname(checkpoint.rstrip("/")), step, rank)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"checkpoint {checkpoint} belongs to a tensor-parallel run, but rank {rank}'s slices ({path}) are "
            "missing: restore that file, or resume from an earlier checkpoint of the run")
    flat = mx.load(path)
    return {group: {k[len(group) + 1:]: v for k, v in flat.items() if k.startswith(group + ".")}  # type: ignore[union-attr]
            for group in ("model", "optimizer")}


def prune_shards(directory: str) -> None:
    """Delete the shard directories whose checkpoint is gone (older than the newest checkpoint only: a
    newer one may still be being written)."""
    root = os.path.join(directory, SHARDS_DIR)
    if not os.path.isdir(root):
        return
    kept = {name for name in os.listdir(directory) if STEP_DIR.match(name)}
    newest = max(kept, default="")
    for name in os.listdir(root):
        if STEP_DIR.match(name) and name not in kept and name < newest:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def reshard(checkpoint: str, arrays: dict[str, dict[str, mx.array]], saved: dict[str, Any],
            layout: Layout, rank: int, size: int) -> dict[str, dict[str, mx.array]]:
    """This rank's ``model``/``optimizer`` arrays from a checkpoint of any layout: its own file when the
    checkpoint was written by ``size`` ranks with the same layout; otherwise the whole arrays (joined
    from every rank's slices, or a whole checkpoint as is) cut into this run's slices. A record without
    ``"sizes"`` (older checkpoints) is of equal slices.
    """
    record = saved.get("tensor_parallel") or {"world_size": 1, "layout": {}}
    world, old_layout = record["world_size"], layout_from_record(record)
    if world == size and same_layout(old_layout, layout):
        return arrays if rank == 0 else {**arrays, **read_shard(checkpoint, saved["step"], rank)}
    parts = [arrays] + [read_shard(checkpoint, saved["step"], r) for r in range(1, world)]
    out = dict(arrays)
    for group in ("model", "optimizer"):
        old_axes = old_layout if group == "model" else optimizer_layout(arrays[group], old_layout)
        new_axes = layout if group == "model" else optimizer_layout(arrays[group], layout)
        whole = {k: mx.concatenate([p[group][k] for p in parts], axis=axis_of(old_axes[k])) if k in old_axes else v
                 for k, v in arrays[group].items()}
        out[group] = take_shard(whole, new_axes, rank, size)
    return out

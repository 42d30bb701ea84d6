"""Checkpoints: atomic, asynchronous, validated; local directories or fsspec URLs.

Names load on first use (``mlx_train._lazy``).

Example::

    from mlx_train.checkpointing import CheckpointManager, load_checkpoint

    manager = CheckpointManager("runs/a/checkpoints", keep_last=3, keep_best=1)
    manager.save(step, {"model": flat_params, "optimizer": flat_opt_state}, state, {"val_loss": 0.4})
    arrays, state = load_checkpoint(manager.resolve("auto"))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_train._lazy import lazy_exports

if TYPE_CHECKING:
    from mlx_train.checkpointing.format import CheckpointInfo, load_checkpoint, step_name, validate_checkpoint
    from mlx_train.checkpointing.manager import CheckpointManager, CheckpointWarning

_LAZY = {
    "CheckpointInfo": "mlx_train.checkpointing.format",
    "load_checkpoint": "mlx_train.checkpointing.format",
    "step_name": "mlx_train.checkpointing.format",
    "validate_checkpoint": "mlx_train.checkpointing.format",
    "CheckpointManager": "mlx_train.checkpointing.manager",
    "CheckpointWarning": "mlx_train.checkpointing.manager",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["CheckpointInfo", "CheckpointManager", "CheckpointWarning", "load_checkpoint", "step_name",
           "validate_checkpoint"]

"""Checkpoints: atomic, asynchronous, validated; local directories or fsspec URLs.

Example::

    from mlx_train.checkpointing import CheckpointManager, load_checkpoint

    manager = CheckpointManager("runs/a/checkpoints", keep_last=3, keep_best=1)
    manager.save(step, {"model": flat_params, "optimizer": flat_opt_state}, state, {"val_loss": 0.4})
    arrays, state = load_checkpoint(manager.resolve("auto"))
"""

from mlx_train.checkpointing.format import CheckpointInfo, load_checkpoint, step_name, validate_checkpoint
from mlx_train.checkpointing.manager import CheckpointManager, CheckpointWarning

__all__ = ["CheckpointInfo", "CheckpointManager", "CheckpointWarning", "load_checkpoint", "step_name",
           "validate_checkpoint"]

"""``mlx_train.checkpoint``: the public name of the checkpoint API (implemented in ``mlx_train.checkpointing``).

Example::

    from mlx_train.checkpoint import CheckpointManager, load_checkpoint

    manager = CheckpointManager("checkpoints", keep_last=3)
    path = manager.resolve("auto")          # None when there is nothing to resume
    if path:
        arrays, state = load_checkpoint(path)
"""

from mlx_train.checkpointing import (
    CheckpointInfo, CheckpointManager, CheckpointWarning, load_checkpoint, step_name, validate_checkpoint,
)

__all__ = ["CheckpointInfo", "CheckpointManager", "CheckpointWarning", "load_checkpoint", "step_name",
           "validate_checkpoint"]

"""Subprocess for tests/test_checkpoint.py: start one checkpoint save and get SIGKILLed in the middle.

Usage: python tests/helpers_checkpoint_kill.py DIRECTORY STEP
The test sets MLX_TRAIN_SAVE_PAUSE_AFTER (the checkpoint writer's test hook) so the save stops
after a chosen file and announces it on stderr; the test then kills this process.
"""

import sys

import mlx_train  # noqa: F401  (before mlx.core: loads the optimized BLAS)

# isort: split
import mlx.core as mx

from mlx_train.checkpointing import CheckpointManager


def arrays_for(step: int) -> dict:
    """Arrays whose values identify the step they were saved at (the test rebuilds them)."""
    return {
        "model": {"w": mx.full((64, 64), float(step)), "b": mx.arange(8).astype(mx.bfloat16) + step},
        "optimizer": {"step": mx.array(step, dtype=mx.uint32)},
    }


def main() -> None:
    directory, step = sys.argv[1], int(sys.argv[2])
    manager = CheckpointManager(directory, keep_last=1, async_save=True)
    manager.save(step, arrays_for(step), {"step": step}, {"val_loss": 1.0 / step})
    manager.wait()
    print("save finished", flush=True)  # only reached when the pause hook is off


if __name__ == "__main__":
    main()

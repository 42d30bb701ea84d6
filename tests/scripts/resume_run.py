"""A training run used by the exact-resume tests: dropout, shuffling, an LR schedule with
warmup, gradient accumulation, EarlyStopping and ModelCheckpoint, checkpoints every 5 steps.

    python resume_run.py RUN_DIR OUT.safetensors [--resume] [--hold-at STEP]

``--hold-at STEP`` stops the run at the end of that step, after writing RUN_DIR/held, and waits to
be killed: a test kills it there however fast or slow the machine is.
"""

import argparse
import json
import os
import time

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_train import TrainConfig
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.optim import build_optimizer
from mlx_train.training import Callback, EarlyStopping, ModelCheckpoint, Trainer


class HoldAt(Callback):
    """Announces the end of step ``step`` in RUN_DIR/held and waits there to be killed (no numerics touched)."""

    def __init__(self, step, run_dir):
        self.step, self.run_dir = step, run_dir

    def on_batch_end(self, trainer, step):
        if step != self.step:
            return
        with open(os.path.join(self.run_dir, "held.tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(self.run_dir, "held.tmp"), os.path.join(self.run_dir, "held"))
        while True:
            time.sleep(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold-at", type=int, default=None)
    args = parser.parse_args()

    data = load_dataset("digits", seed=0)
    config = TrainConfig(
        batch_size=8, gradient_accumulation=2, epochs=6, learning_rate=3e-3, warmup_steps=10,
        lr_schedule="cosine_decay", lr_schedule_args=[400, 1e-4], checkpoint_every="5 steps",
        keep_last=2, report_every="25 steps", seed=3, run_dir=args.run_dir, num_workers=2,
    )
    mx.random.seed(config.seed)
    model = build_model("mlp", data["info"], hidden_dims=[64], dropout=0.3)
    callbacks = [
        EarlyStopping(monitor="val_loss", patience=2, min_delta=0.03, restore_best_weights=True),
        ModelCheckpoint(f"{args.run_dir}/best.safetensors", monitor="val_accuracy", save_best_only=True),
    ]
    if args.hold_at is not None:
        callbacks.append(HoldAt(args.hold_at, args.run_dir))
    trainer = Trainer(model, build_optimizer(config), config=config)
    history = trainer.train(data["train"], data["val"], checkpoint_dir=f"{args.run_dir}/checkpoints",
                            callbacks=callbacks, resume="auto" if args.resume else None)
    mx.save_safetensors(args.out, dict(tree_flatten(model.parameters())))
    with open(args.out + ".json", "w") as f:
        json.dump({"history": history, "step": trainer.step, "stopped_epoch": callbacks[0].stopped_epoch}, f)


if __name__ == "__main__":
    main()

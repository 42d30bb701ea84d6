"""A run used by the pruning/EMA exact-resume tests: an MLP with dropout on the digits, AdamW,
gradual magnitude pruning to 80% (masks every 10 steps from step 5 to 200), an EMA of the
weights masked like them, checkpoints every 5 steps.

    python prune_resume_run.py RUN_DIR OUT.safetensors [--resume] [--hold-after-save STEP]

OUT holds the parameters, OUT.ema.safetensors the EMA weights and the masks, OUT.json the history.

``--hold-after-save STEP`` stops the run once the checkpoint of that step is written (committed,
old ones deleted), writes "saved:STEP" to RUN_DIR/held and waits there to be killed: a test kills
it at that point however fast or slow the machine is.
"""

import argparse
import json
import os
import threading

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_train import TrainConfig
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.checkpointing import CheckpointManager
from mlx_train.optim import build_optimizer
from mlx_train.training import EMA, Callback, Pruning, Trainer

# isort: split
from hold import Hold  # tests/scripts/hold.py, next to this script


class HoldAfterSave(Callback):
    """Holds the training thread at the checkpoint of the hold's step once its background writer
    has finished it (no numerics touched)."""

    def __init__(self, hold):
        self.hold, self.written, self.changed = hold, set(), threading.Condition()
        write = CheckpointManager._write

        def reported(manager, job):
            try:
                return write(manager, job)
            finally:  # a failed save must not leave the training thread waiting: its error is raised
                with self.changed:
                    self.written.add(job.step)
                    self.changed.notify_all()

        CheckpointManager._write = reported

    def on_checkpoint(self, trainer, path):
        if self.hold.due("saved", trainer.step):
            with self.changed:
                self.changed.wait_for(lambda: trainer.step in self.written)
        self.hold.at("saved", trainer.step)


def announce_in(run_dir):
    """Write the point the run holds at to RUN_DIR/held, atomically."""
    def announce(point):
        with open(os.path.join(run_dir, "held.tmp"), "w") as f:
            f.write(point)
        os.replace(os.path.join(run_dir, "held.tmp"), os.path.join(run_dir, "held"))

    return announce


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold-after-save", type=int, metavar="STEP", default=None)
    args = parser.parse_args()

    data = load_dataset("digits", seed=0)
    config = TrainConfig(batch_size=16, epochs=3, learning_rate=3e-3, weight_decay=0.01, optimizer="adamw",
                         checkpoint_every="5 steps", keep_last=2, report_every="10 steps", eval_every="50 steps",
                         seed=5, run_dir=args.run_dir)
    mx.random.seed(config.seed)
    model = build_model("mlp", data["info"], hidden_dims=[64], dropout=0.2)
    pruning = Pruning(sparsity=0.8, start_step=5, end_step=200, frequency=10)
    ema = EMA(decay=0.95, pruning=pruning)
    callbacks = [pruning, ema]
    if args.hold_after_save is not None:
        callbacks.append(HoldAfterSave(Hold(f"saved:{args.hold_after_save}", None, announce_in(args.run_dir))))
    trainer = Trainer(model, build_optimizer(config), config=config)
    history = trainer.train(data["train"], data["val"], checkpoint_dir=f"{args.run_dir}/checkpoints",
                            callbacks=callbacks, resume="auto" if args.resume else None)
    mx.save_safetensors(args.out, dict(tree_flatten(model.parameters())))
    extra = {f"ema/{k}": v for k, v in ema.weights().items()}
    extra.update({f"mask/{k}": v for k, v in pruning.step_state["masks"].items()})
    extra.update({f"opt/{k}": v for k, v in tree_flatten(trainer.optimizer.state)})
    mx.save_safetensors(args.out + ".ema.safetensors", extra)
    with open(args.out + ".json", "w") as f:
        json.dump({"history": history, "step": trainer.step, "sparsity": pruning.sparsity()}, f)


if __name__ == "__main__":
    main()

"""A run used by the pruning/EMA exact-resume tests: an MLP with dropout on the digits, AdamW,
gradual magnitude pruning to 80% (masks every 10 steps from step 5 to 200), an EMA of the
weights masked like them, checkpoints every 5 steps.

    python prune_resume_run.py RUN_DIR OUT.safetensors [--resume] [--slow SECONDS]

OUT holds the parameters, OUT.ema.safetensors the EMA weights and the masks, OUT.json the history.
"""

import argparse
import json
import time

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_train import TrainConfig
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.optim import build_optimizer
from mlx_train.training import EMA, Callback, Pruning, Trainer


class Slow(Callback):
    """Sleeps after each step so a test can kill the run mid-way (does not touch numerics)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def on_batch_end(self, trainer, step):
        time.sleep(self.seconds)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--slow", type=float, default=0.0)
    args = parser.parse_args()

    data = load_dataset("digits", seed=0)
    config = TrainConfig(batch_size=16, epochs=3, learning_rate=3e-3, weight_decay=0.01, optimizer="adamw",
                         checkpoint_every="5 steps", keep_last=2, report_every="10 steps", eval_every="50 steps",
                         seed=5, run_dir=args.run_dir)
    mx.random.seed(config.seed)
    model = build_model("mlp", data["info"], hidden_dims=[64], dropout=0.2)
    pruning = Pruning(sparsity=0.8, start_step=5, end_step=200, frequency=10)
    ema = EMA(decay=0.95, pruning=pruning)
    callbacks = [pruning, ema] + ([Slow(args.slow)] if args.slow else [])
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

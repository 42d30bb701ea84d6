"""A run that sends itself a signal at a chosen step (SIGTERM/SIGINT as a scheduler or Ctrl-C would),
used by the preemption tests. Dropout, shuffling and gradient accumulation are on.

    python signal_run.py RUN_DIR OUT.safetensors [--signal-at STEP --signal TERM|INT [--twice]] [--resume]
"""

import argparse
import json
import os
import signal

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_train.builtin.models import MLP
from mlx_train.training import Callback, Trainer


class SignalAt(Callback):
    def __init__(self, step, signum, twice):
        self.step, self.signum, self.twice = step, signum, twice

    def on_batch_end(self, trainer, step):
        if step == self.step:
            os.kill(os.getpid(), self.signum)
            if self.twice:
                os.kill(os.getpid(), self.signum)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--signal-at", type=int)
    parser.add_argument("--signal", default="TERM")
    parser.add_argument("--twice", action="store_true")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 8)).astype(np.float32)
    y = rng.integers(0, 3, 96).astype(np.int32)
    mx.random.seed(1)
    model = MLP(in_dims=8, hidden_dims=(16,), num_classes=3, dropout=0.2)
    trainer = Trainer(model, batch_size=4, gradient_accumulation=2, epochs=3, checkpoint_every="5 steps",
                      report_every="4 steps", eval_every="6 steps", seed=2, num_workers=0, run_dir=args.run_dir)
    callbacks = []
    if args.signal_at:
        callbacks.append(SignalAt(args.signal_at, getattr(signal, "SIG" + args.signal), args.twice))
    trainer.train((x, y), (x[:16], y[:16]), checkpoint_dir=os.path.join(args.run_dir, "checkpoints"),
                  callbacks=callbacks, resume="auto" if args.resume else None)
    mx.save_safetensors(args.out, dict(tree_flatten(model.parameters())))
    with open(args.out + ".json", "w") as f:
        json.dump({"history": trainer.history, "step": trainer.step}, f)


if __name__ == "__main__":
    main()

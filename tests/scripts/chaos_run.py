"""One attempt of a chaos trial (bench/chaos.py, tests/test_chaos.py): a short training run that
an outside process may SIGKILL, SIGTERM or SIGINT at any moment, and then resume.

    python chaos_run.py MODEL RUN_DIR OUT.safetensors PROGRESS.json [--resume] [--hold PHASE:STEP --go FILE]

MODEL is ``mlp``, ``cnn`` or ``transformer`` (the built-in models, with dropout). Data is synthetic
and fixed by a NumPy seed; the loader shuffles, gradient accumulation is 2, validation runs every
4 steps and a checkpoint is saved every 5 steps (and at epoch ends), so a signal sent at a random
time lands in a step, a validation or a background checkpoint save.

PROGRESS.json tells the sender where the run is, rewritten atomically whenever that changes:
``{"step": last finished optimizer step or null before the first, "start_step": the step training
started from, "validating": bool, "saving": bool, "finished": bool, "held": null or "PHASE:STEP"}``
(``finished``: train() has returned). ``step`` is written in ``on_batch_end``, so it is the step the
run had reached. A run that goes to the end writes its final parameters to OUT and
``{"step", "start_step"}`` to OUT.json.

``--hold PHASE:STEP`` stops the run at one chosen point until the file ``--go`` exists: PHASE is
``step`` (the end of that optimizer step), ``validation`` (the validation run after that step) or
``save`` (the background writer, about to write that step's checkpoint). The run then writes
``"held"`` to PROGRESS.json, so a sender signals it at that point whatever the machine's speed.
"""

import argparse
import json
import os
import signal
import threading

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_train import TrainConfig
from mlx_train.builtin.models import MLP, CharTransformerLM, SmallCNN
from mlx_train.checkpointing import CheckpointManager
from mlx_train.optim import build_optimizer
from mlx_train.training import Callback, Trainer

# isort: split
from hold import Hold  # tests/scripts/hold.py, next to this script

MODELS = ("mlp", "cnn", "transformer")
TRAIN_SAMPLES, VAL_SAMPLES, STEP_SAMPLES, ACCUMULATION, EPOCHS = 384, 48, 16, 2, 3
VOCAB, BLOCK = 13, 16


class Progress:
    """The PROGRESS.json writer, shared by the training thread and the checkpoint writer thread."""

    def __init__(self, path: str) -> None:
        self.path, self.lock = path, threading.Lock()
        self.fields = {"step": None, "start_step": None, "validating": False, "saving": False,
                       "finished": False, "held": None}

    def update(self, **fields) -> None:
        with self.lock:
            self.fields.update(fields)
            tmp = f"{self.path}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.fields, f)
            os.replace(tmp, self.path)


class ReportProgress(Callback):
    def __init__(self, progress: Progress, hold: Hold) -> None:
        self.progress, self.hold = progress, hold

    def on_fit_start(self, trainer) -> None:
        self.progress.update(start_step=trainer.step, step=trainer.step)

    def on_batch_end(self, trainer, step: int) -> None:
        self.progress.update(step=step)
        self.hold.at("step", step)

    def on_validation_end(self, trainer, logs: dict) -> None:
        self.progress.update(validating=False)


class ValSet:
    """Map-style validation set that marks the run as validating when read."""

    def __init__(self, arrays: dict, progress: Progress, hold: Hold) -> None:
        self.arrays, self.progress, self.hold = arrays, progress, hold

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, index: int):
        if index == 0:
            self.progress.update(validating=True)
            self.hold.at("validation", self.progress.fields["step"])
        if "tokens" in self.arrays:
            return self.arrays["tokens"][index]
        return self.arrays["x"][index], self.arrays["y"][index]


def mark_saves(progress: Progress, hold: Hold) -> None:
    """Mark the run as saving while the checkpoint writer writes (it runs in its own thread)."""
    write = CheckpointManager._write

    def marked(self, job):
        progress.update(saving=True)
        try:
            hold.at("save", job.step)
            return write(self, job)
        finally:
            progress.update(saving=False)

    CheckpointManager._write = marked


def build(model_name: str):
    """(model, train arrays, val arrays) for MODEL; the data is fixed by a NumPy seed."""
    rng = np.random.default_rng(11)
    n = TRAIN_SAMPLES + VAL_SAMPLES
    if model_name == "transformer":
        steps = rng.integers(1, 4, size=(n, BLOCK + 1))
        arrays = {"tokens": (np.cumsum(steps, axis=1) % VOCAB).astype(np.int32)}
        model = CharTransformerLM(VOCAB, dims=32, num_heads=2, num_layers=2, block_size=32, dropout=0.1)
    else:
        x = rng.normal(size=(n, 64)).astype(np.float32)
        arrays = {"x": x, "y": x[:, :4].argmax(axis=1).astype(np.int32)}
        if model_name == "mlp":
            model = MLP(64, hidden_dims=(64, 64), num_classes=4, dropout=0.3)
        elif model_name == "cnn":
            model = SmallCNN(image_shape=(8, 8, 1), num_classes=4, channels=(8, 16), hidden_dims=32, dropout=0.2)
        else:
            raise SystemExit(f"unknown model {model_name!r}: expected one of {', '.join(MODELS)}")
    train = {k: v[:TRAIN_SAMPLES] for k, v in arrays.items()}
    val = {k: v[TRAIN_SAMPLES:] for k, v in arrays.items()}
    return model, train, val


def main() -> None:
    # A process started in the background may inherit an ignored SIGINT: restore Python's default
    # (KeyboardInterrupt), as in a terminal, so SIGINT means the same at every moment of the run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("progress")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold", metavar="PHASE:STEP", help="step, validation or save, and the step")
    parser.add_argument("--go", metavar="FILE", help="a held run goes on once this file exists")
    args = parser.parse_args()

    progress = Progress(args.progress)
    hold = Hold(args.hold, args.go, lambda point: progress.update(held=point))
    mark_saves(progress, hold)
    config = TrainConfig(
        batch_size=STEP_SAMPLES // ACCUMULATION, gradient_accumulation=ACCUMULATION, epochs=EPOCHS,
        optimizer="adamw", learning_rate=3e-3, warmup_steps=4, lr_schedule="cosine_decay",
        lr_schedule_args=[80, 1e-4], report_every="5 steps", eval_every="4 steps", checkpoint_every="5 steps",
        keep_last=2, seed=5, run_dir=args.run_dir, num_workers=1,
    )
    mx.random.seed(config.seed)
    model, train, val = build(args.model)
    trainer = Trainer(model, build_optimizer(config), config=config)
    progress.update()  # the sender's signal window starts here
    trainer.train(train, ValSet(val, progress, hold), checkpoint_dir=os.path.join(args.run_dir, "checkpoints"),
                  callbacks=[ReportProgress(progress, hold)], resume="auto" if args.resume else None)
    progress.update(finished=True)  # train() has returned: its signal handlers are gone
    mx.save_safetensors(args.out, dict(tree_flatten(model.parameters())))
    with open(args.out + ".json", "w") as f:
        json.dump({"step": trainer.step, "start_step": progress.fields["start_step"]}, f)


if __name__ == "__main__":
    main()

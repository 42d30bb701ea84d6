"""One training run of the resume matrix (tests/test_resume_matrix.py), optionally SIGKILLed
at a deterministic point and optionally resumed with ``resume="auto"``.

    python resume_matrix_run.py MODEL ACCUMULATION RUN_DIR OUT.safetensors [--resume]

MODEL is one of ``mlp`` (dropout), ``cnn``, ``transformer`` (the built-in CharTransformerLM),
``lora`` (a frozen transformer with trainable low-rank adapters) or ``parameterless`` (an MLP
that holds activation and dropout modules as attributes). Every run: 64 training samples,
8 samples per optimizer step (``batch_size = 8 / ACCUMULATION``), so 8 steps per epoch and
32 steps in 4 epochs; a report every 5 steps, validation every 4, a checkpoint every 3.

The kill point comes from the environment (``MLX_TRAIN_TEST_KILL=KIND:STEP``):

- ``step:N``: at the end of optimizer step N (``on_batch_end``), once the checkpoint saves
  submitted so far are on disk (so which checkpoint the resume starts from is fixed);
- ``save:N``: in the checkpoint writer, right after the first file of the step-N save is written
  (through the checkpoint manager's test hook), leaving a torn temporary directory;
- ``val:N``: while validation after step N reads the validation set (also once the submitted
  saves are complete).

The process kills itself with SIGKILL: no handler, no flush, no cleanup runs. Without
``MLX_TRAIN_TEST_KILL`` the run goes to the end and writes the final parameters to OUT and
``{"history", "step", "start_step"}`` to OUT.json (``start_step``: where training started, the
checkpoint's step when resumed).
"""

import argparse
import json
import os
import signal

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

import mlx_train.checkpointing.manager as manager_module
from mlx_train import TrainConfig
from mlx_train.builtin.models import MLP, CharTransformerLM, SmallCNN
from mlx_train.checkpointing import CheckpointManager
from mlx_train.optim import build_optimizer
from mlx_train.training import Callback, Trainer

TRAIN_SAMPLES, VAL_SAMPLES, STEP_SAMPLES, EPOCHS = 64, 24, 8, 4
VOCAB, BLOCK = 11, 8
SAVING: list = []  # every CheckpointManager that saved in this process (see track_managers)


def die(wait_for_saves: bool = False) -> None:
    """SIGKILL this process; first let the submitted checkpoint saves finish when asked (so the
    checkpoint a resume starts from does not depend on how fast the writer thread was)."""
    if wait_for_saves:
        for manager in SAVING:
            manager.wait()
    os.kill(os.getpid(), signal.SIGKILL)


# -- models -------------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update ``x @ A @ B * scale`` (B starts at zero)."""

    def __init__(self, linear: nn.Linear, rank: int = 2, scale: float = 2.0) -> None:
        super().__init__()
        out_dims, in_dims = linear.weight.shape
        self.linear = linear
        self.scale = scale
        self.lora_a = mx.random.uniform(-1 / in_dims**0.5, 1 / in_dims**0.5, (in_dims, rank))
        self.lora_b = mx.zeros((rank, out_dims))

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear(x) + (x @ self.lora_a @ self.lora_b) * self.scale


class TinyBlock(nn.Module):
    """A pre-norm transformer block written with mlx.nn only."""

    def __init__(self, dims: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dims)
        self.attention = nn.MultiHeadAttention(dims, heads)
        self.norm2 = nn.LayerNorm(dims)
        self.up = nn.Linear(dims, 2 * dims)
        self.down = nn.Linear(2 * dims, dims)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, mask="causal")
        return x + self.down(nn.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dims: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dims)
        self.block = TinyBlock(dims, heads)
        self.norm = nn.LayerNorm(dims)
        self.head = nn.Linear(dims, vocab)

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.head(self.norm(self.block(self.embedding(tokens))))


def lora_model() -> nn.Module:
    """TinyLM with the whole base frozen and LoRA adapters on the attention and MLP projections."""
    model = TinyLM(VOCAB)
    model.freeze()
    attention, block = model.block.attention, model.block
    attention.query_proj = LoRALinear(attention.query_proj)
    attention.value_proj = LoRALinear(attention.value_proj)
    block.up = LoRALinear(block.up)
    block.down = LoRALinear(block.down)
    return model


class Parameterless(nn.Module):
    """Parameterless submodules held as attributes and inside a list."""

    def __init__(self, in_dims: int, classes: int) -> None:
        super().__init__()
        self.first = nn.Linear(in_dims, 24)
        self.activation = nn.ReLU()
        self.drop = nn.Dropout(0.25)
        self.identity = nn.Identity()
        self.body = [nn.Linear(24, 24), nn.GELU(), nn.Dropout(0.1)]
        self.last = nn.Linear(24, classes)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.drop(self.activation(self.first(x)))
        for layer in self.body:
            x = layer(x)
        return self.last(self.identity(x))


def build(model_name: str) -> tuple[nn.Module, dict, dict]:
    """(model, train samples, val samples) for MODEL, the data fixed by a NumPy seed."""
    rng = np.random.default_rng(7)
    n = TRAIN_SAMPLES + VAL_SAMPLES
    if model_name in ("transformer", "lora"):
        tokens = (np.cumsum(rng.integers(1, 3, size=(n, BLOCK + 1)), axis=1) % VOCAB).astype(np.int32)
        arrays = {"tokens": tokens}
    else:
        x = rng.normal(size=(n, 64)).astype(np.float32)
        y = (x[:, :4].argmax(axis=1)).astype(np.int32)
        arrays = {"x": x, "y": y}
    train = {k: v[:TRAIN_SAMPLES] for k, v in arrays.items()}
    val = {k: v[TRAIN_SAMPLES:] for k, v in arrays.items()}
    if model_name == "mlp":
        model = MLP(64, hidden_dims=(32,), num_classes=4, dropout=0.3)
    elif model_name == "cnn":
        model = SmallCNN(image_shape=(8, 8, 1), num_classes=4, channels=(4, 8), hidden_dims=16, dropout=0.2)
    elif model_name == "transformer":
        model = CharTransformerLM(VOCAB, dims=16, num_heads=2, num_layers=1, block_size=32, dropout=0.1)
    elif model_name == "lora":
        model = lora_model()
    elif model_name == "parameterless":
        model = Parameterless(64, 4)
    else:
        raise SystemExit(f"unknown model {model_name!r}")
    return model, train, val


# -- kill points --------------------------------------------------------------------------


class KillAtStep(Callback):
    """SIGKILL at the end of step ``at`` once the submitted checkpoint saves are complete."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_batch_end(self, trainer, step: int) -> None:
        if step == self.at:
            die(wait_for_saves=True)


class StartStep(Callback):
    """Remembers the step training started from (0, or the step of the checkpoint resumed from)."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_fit_start(self, trainer) -> None:
        self.step = trainer.step


class KillingValSet:
    """Map-style validation set that SIGKILLs the process when read after step ``at``.

    Token samples are read one by one as bare sequences, which the loader pads to a multiple of 32
    (with a mask): the built-in transformer gets a ``block_size`` that fits the padded length.
    """

    def __init__(self, arrays: dict, trainer_box: list, at: int | None) -> None:
        self.arrays, self.trainer_box, self.at = arrays, trainer_box, at

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, index: int) -> tuple | np.ndarray:
        if self.at is not None and self.trainer_box and self.trainer_box[0].step == self.at:
            die(wait_for_saves=True)
        if "tokens" in self.arrays:  # a bare token sequence: the loader pads it and adds a mask
            return self.arrays["tokens"][index]
        return self.arrays["x"][index], self.arrays["y"][index]


def track_managers() -> None:
    save = CheckpointManager.save

    def tracked(self, *args, **kwargs):
        if self not in SAVING:
            SAVING.append(self)
        return save(self, *args, **kwargs)

    CheckpointManager.save = tracked


def kill_during_save(step: int) -> None:
    if not hasattr(manager_module, "_pause_point"):
        raise SystemExit("the checkpoint writer's test hook _pause_point is gone: update this script")
    name = f"step-{step:08d}.tmp"
    original = manager_module._pause_point

    def hook(point: str, where: str) -> None:
        if name in where and point.endswith(".safetensors"):
            die()
        original(point, where)

    manager_module._pause_point = hook


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("accumulation", type=int)
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    kind, _, at = os.environ.get("MLX_TRAIN_TEST_KILL", "").partition(":")
    if kind not in ("", "step", "save", "val"):
        raise SystemExit(f"MLX_TRAIN_TEST_KILL={kind}:{at}: expected step:N, save:N or val:N")
    at = int(at) if at else None
    track_managers()
    if kind == "save":
        kill_during_save(at)

    config = TrainConfig(
        batch_size=STEP_SAMPLES // args.accumulation, gradient_accumulation=args.accumulation, epochs=EPOCHS,
        optimizer="adamw", learning_rate=1e-2, warmup_steps=4, lr_schedule="cosine_decay",
        lr_schedule_args=[40, 1e-4], report_every="5 steps", eval_every="4 steps", checkpoint_every="3 steps",
        keep_last=2, seed=3, run_dir=args.run_dir, num_workers=1,
    )
    mx.random.seed(config.seed)
    model, train, val = build(args.model)
    trainer_box: list = []
    val_set = KillingValSet(val, trainer_box, at if kind == "val" else None)
    trainer = Trainer(model, build_optimizer(config), config=config)
    trainer_box.append(trainer)
    start = StartStep()
    history = trainer.train(train, val_set, checkpoint_dir=f"{args.run_dir}/checkpoints",
                            callbacks=[KillAtStep(at if kind == "step" else None), start],
                            resume="auto" if args.resume else None)
    mx.save_safetensors(args.out, dict(tree_flatten(model.parameters())))
    with open(args.out + ".json", "w") as f:
        json.dump({"history": history, "step": trainer.step, "start_step": start.step}, f)


if __name__ == "__main__":
    main()

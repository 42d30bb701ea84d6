"""The Trainer against the training loop MLX users write by hand, the way mlx-lm's trainer is written.

The digits MLP, trained for ``--epochs`` epochs per round by both sides, alternating, ``--rounds`` rounds:

- ``hand``: the data held by MLX (one ``mx.array`` per split, made once), each batch gathered by index from
  a shuffled order, one ``mx.compile``d step with the model, optimizer and random state captured, one
  ``mx.eval`` of that state and the loss per step, the loss never read;
- ``trainer``: ``Trainer(model, optimizer, batch_size=...).train((x, y), epochs=...)`` with its defaults
  (a report line every 10 steps, printed to a discarded stdout).

Each round builds a fresh model, optimizer and compiled step on both sides, and times the whole call
(compilation included). The table gives each round's seconds and the Trainer's speed as a fraction of
the hand loop's (hand seconds / Trainer seconds), and their median.

    python bench/hand_loop.py                    # 5 rounds of 10 epochs
    python bench/hand_loop.py --rounds 9 --epochs 5
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from functools import partial

import mlx_train  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.training import Trainer


def hand(data, info, batch_size: int, epochs: int) -> float:
    """Seconds for ``epochs`` epochs of the hand-written loop (see the module docstring)."""
    start = time.perf_counter()
    mx.random.seed(0)
    model = build_model("mlp", info)
    optimizer = optim.AdamW(learning_rate=1e-3)
    state = [model.state, optimizer.state, mx.random.state]

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y).mean()

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        optimizer.update(model, grads)
        return loss

    x, y = (mx.array(a) for a in data)
    n = x.shape[0]
    for epoch in range(epochs):
        order = mx.array(np.random.default_rng([0, epoch]).permutation(n), dtype=mx.int32)
        for i in range(0, n - batch_size + 1, batch_size):
            idx = order[i:i + batch_size]
            loss = step(x[idx], y[idx])
            mx.eval(state, loss)
    return time.perf_counter() - start


def trainer(data, info, batch_size: int, epochs: int) -> float:
    """Seconds for ``Trainer.train`` over the same epochs, with its defaults."""
    start = time.perf_counter()
    mx.random.seed(0)
    model = build_model("mlp", info)
    with contextlib.redirect_stdout(io.StringIO()):
        Trainer(model, optim.AdamW(learning_rate=1e-3), batch_size=batch_size, drop_last=True).train(
            data, epochs=epochs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    digits = load_dataset("digits", seed=0)
    data, info = digits["train"], digits["info"]
    steps = (len(data[0]) // args.batch_size) * args.epochs
    print(f"digits MLP, {len(data[0])} samples, batch {args.batch_size}, {args.epochs} epochs "
          f"({steps} steps) per side per round, {args.rounds} alternating rounds")
    print(f"{'round':>5} {'hand s':>8} {'trainer s':>10} {'trainer/hand speed':>19}")
    ratios = []
    for round_number in range(1, args.rounds + 1):
        first, second = (hand, trainer) if round_number % 2 else (trainer, hand)
        times = {first.__name__: first(data, info, args.batch_size, args.epochs)}
        times[second.__name__] = second(data, info, args.batch_size, args.epochs)
        ratios.append(times["hand"] / times["trainer"])
        print(f"{round_number:>5} {times['hand']:>8.3f} {times['trainer']:>10.3f} {ratios[-1]:>19.3f}")
    print(f"median trainer/hand speed: {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()

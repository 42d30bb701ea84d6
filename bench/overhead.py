"""Trainer overhead: mlx-train's Trainer against a hand-written compiled MLX loop.

All sides train the same model on the same data with the same batch size, in this process,
alternating rounds so machine noise hits each. The hand-written loop is written the way mlx-lm's
trainer is: one ``mx.compile``d step with model/optimizer/RNG state captured, lazily summed losses,
``mx.eval`` once per step, a report every 10 steps. It runs three ways:

- ``hand``: what mlx-lm's report does, as plain Python: each step's time is taken (``perf_counter``
  before and after), and every 10 steps the loss, the item count and the learning rate are read and one
  line with loss, learning rate, steps/s, items/s, items trained and peak memory is printed (to the same
  redirected stdout as the Trainer's report line; mlx-lm prints it through rich, which costs more);
- ``bare``: the loop alone, reading only the loss at a report and printing nothing. The Trainer prints
  its report line by default (``ProgressBar``), so this side does less than a user of either gets;
- ``bare-mx``: the bare loop with its batches gathered by MLX from MLX arrays made once (the Trainer's
  DataLoader does so for arrays up to 256 MB; mlx-lm's batches go through NumPy like ``hand``'s): the
  Trainer against it is the cost of the Trainer's own loop with the same data path.

Both clocks start at the report of step 10 (compilation and warm-up left out) and stop after the last
step; the Trainer is timed from its ``on_report`` and ``on_fit_end`` events, so no per-batch callback is
added to it. Each side is timed three ways: wall time (the ratio that matters on a quiet machine); this
process's CPU time, all threads (``time.process_time``); and the main thread's CPU time per step
(``time.thread_time``: the host work of the loop, from data to dispatch and bookkeeping, while MLX
computes on its own threads). On a machine shared with other jobs the CPU times move far less with
their load, which mostly makes wall time wait.
Workloads: ``mlp`` (the digits MLP) and ``transformer`` (the character-level transformer on the
built-in text corpus).

    python bench/overhead.py            # both workloads: the MLP 41 rounds, the transformer 5
    python bench/overhead.py --rounds 15 --workload mlp
    python bench/overhead.py --rounds 31 --steps 400 --workload mlp     # a busy machine: short rounds
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

WORKLOADS = {
    # name: (dataset, model, model options, batch size, epochs, steps per round)
    "mlp": ("digits", "mlp", {}, 32, 60, 2000),
    "transformer": ("text", "transformer", {}, 32, 1, 70),
}
# Rounds when --rounds is not given: an MLP round is under a second and single rounds range 0.8-1.3 on a
# 2-core box, so its median needs many (41: two minutes); a transformer round is ~45 s.
DEFAULT_ROUNDS = {"mlp": 41, "transformer": 5}


def _arrays(split):
    return split if isinstance(split, tuple) else (split["tokens"],)


def _loss(model, *batch):
    if len(batch) == 2:
        x, y = batch
        return nn.losses.cross_entropy(model(x), y).mean(), mx.array(x.shape[0])
    (tokens,) = batch
    logits = model(tokens[:, :-1])
    return nn.losses.cross_entropy(logits.astype(mx.float32), tokens[:, 1:]).mean(), mx.array(tokens[:, 1:].size)


def hand_written(data, info, name, options, batch_size, epochs, max_steps, report_line=True, on_device=False):
    """The baseline: a compiled step and a plain loop, mlx-lm style; ``report_line=False`` is the bare loop,
    ``on_device=True`` gathers its batches from MLX arrays (see the module docstring). Returns ``_rates``."""
    mx.random.seed(0)
    model = build_model(name, info, **options)
    optimizer = optim.AdamW(learning_rate=1e-3)
    state = [model.state, optimizer.state, mx.random.state]
    loss_and_grad = nn.value_and_grad(model, _loss)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(*batch):
        (loss, n), grads = loss_and_grad(model, *batch)
        optimizer.update(model, grads)
        return loss, n

    arrays = _arrays(data)
    n = len(arrays[0])
    held = [mx.array(a) for a in arrays] if on_device else None
    steps, losses, items = 0, mx.array(0.0), mx.array(0.0)
    train_time, trained = 0.0, 0.0
    start = None
    for epoch in range(epochs):
        order = np.random.default_rng([0, epoch]).permutation(n)
        if held is not None:
            order = mx.array(order, dtype=mx.int32)
        for i in range(0, n - batch_size + 1, batch_size):
            tic = time.perf_counter()
            idx = order[i:i + batch_size]
            batch = [a[idx] for a in held] if held is not None else [mx.array(a[idx]) for a in arrays]
            loss, count = step(*batch)
            losses, items = losses + loss * count, items + count
            mx.eval(state, losses, items)
            train_time += time.perf_counter() - tic
            steps += 1
            if steps % 10 == 0:
                if report_line:
                    _report_line(steps, losses.item(), items.item(), optimizer.learning_rate.item(), train_time,
                                 trained)
                    trained += items.item()
                else:
                    _ = (losses / items).item()
                losses, items, train_time = mx.array(0.0), mx.array(0.0), 0.0
            if steps == WARMUP:
                start = _clocks()  # compilation and warm-up left out
            if steps >= max_steps:
                return _rates(steps - WARMUP, start, _clocks())
    return _rates(steps - WARMUP, start, _clocks())


def _report_line(step, loss_sum, items, learning_rate, seconds, trained):
    """mlx-lm's report line (its ``report_train``), printed plainly."""
    print(f"Iter {step}: Train loss {loss_sum / items:.3f}, Learning Rate {learning_rate:.3e}, "
          f"It/sec {10 / seconds:.3f}, Items/sec {items / seconds:.3f}, Trained Items {trained + items:.0f}, "
          f"Peak mem {mx.get_peak_memory() / 1e9:.3f} GB", flush=True)


WARMUP = 10  # steps before the clocks start (a report is due there on both sides)


def _clocks() -> tuple[float, float, float]:
    return time.perf_counter(), time.process_time(), time.thread_time()


def _rates(steps: int, start: tuple[float, ...], end: tuple[float, ...]) -> tuple[float, float, float]:
    """(steps per wall second, steps per CPU second of this process, main-thread CPU microseconds per step)."""
    return steps / (end[0] - start[0]), steps / (end[1] - start[1]), (end[2] - start[2]) / steps * 1e6


class _Timer:
    """Starts the clock at the report of step ``WARMUP`` and stops it when training ends (no per-batch hook)."""

    def __init__(self):
        self.start = self.end = None
        self.steps = 0

    def on_report(self, trainer, logs):
        if logs["step"] == WARMUP:
            self.start = _clocks()

    def on_fit_end(self, trainer, history):
        self.end, self.steps = _clocks(), trainer.step


def with_trainer(data, info, name, options, batch_size, epochs, max_steps):
    mx.random.seed(0)
    model = build_model(name, info, **options)
    optimizer = optim.AdamW(learning_rate=1e-3)
    timer = _Timer()
    trainer = Trainer(model, optimizer, batch_size=batch_size, report_every="10 steps", max_steps=max_steps)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(data, epochs=epochs, callbacks=[timer])
    return _rates(timer.steps - WARMUP, timer.start, timer.end)


def _hand(*args):
    with contextlib.redirect_stdout(io.StringIO()):  # where the Trainer's report lines go too
        return hand_written(*args)


def _bare(*args):
    return hand_written(*args, report_line=False)


def _bare_on_device(*args):
    return hand_written(*args, report_line=False, on_device=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="alternating rounds (default: 41 for the MLP, 5 for the "
                        "transformer)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append")
    parser.add_argument("--steps", type=int, help="steps per round (default: the workload's); on a busy machine "
                        "many short rounds give steadier medians than a few long ones")
    args = parser.parse_args()
    from mlx_train import _blas

    print(f"MLX {mx.__version__}, device {mx.default_device()}, BLAS: {_blas.describe()}")
    rows = []
    for workload in args.workload or sorted(WORKLOADS):
        dataset, name, options, batch_size, epochs, max_steps = WORKLOADS[workload]
        max_steps = args.steps or max_steps
        splits = load_dataset(dataset, seed=0)
        results = {"hand": [], "bare": [], "bare-mx": [], "Trainer": []}
        sides = [(results["hand"], _hand), (results["bare"], _bare), (results["bare-mx"], _bare_on_device),
                 (results["Trainer"], with_trainer)]
        rounds = args.rounds or DEFAULT_ROUNDS[workload]
        for i in range(rounds):  # the order alternates too: no order effect favours one side
            for out, run in sides if i % 2 == 0 else sides[::-1]:
                out.append(run(splits["train"], splits["info"], name, options, batch_size, epochs, max_steps))
        ours = results["Trainer"]
        ratios = {}
        for base in BASELINES:
            wall = [o[0] / h[0] for h, o in zip(results[base], ours, strict=True)]
            cpu = [o[1] / h[1] for h, o in zip(results[base], ours, strict=True)]
            print(f"{workload}, Trainer / {base}: per-round ratios, wall " + " ".join(f"{r:.3f}" for r in wall) +
                  "; CPU " + " ".join(f"{r:.3f}" for r in cpu))
            ratios[base] = (statistics.median(wall), min(wall), max(wall), statistics.median(cpu))
        rates = {side: statistics.median(r[0] for r in runs) for side, runs in results.items()}
        host = {side: statistics.median(r[2] for r in runs) for side, runs in results.items()}
        rows.append((workload, rounds, rates, ratios, host))
    print("\n(medians of the rounds; ratios: Trainer / hand-written, over 1 the Trainer is faster)")
    names = ", ".join((*BASELINES, "Trainer"))
    print(f"{'workload':<12} {'rounds':>6} {'steps/s ' + names:>38} {'wall ratio vs hand':>19} {'vs bare':>8} "
          f"{'vs bare-mx':>11} {'CPU ratio vs hand':>18} {'vs bare':>8} {'vs bare-mx':>11} "
          f"{'main-thread us/step ' + names:>50}")
    for workload, rounds, rates, ratios, host in rows:
        print(f"{workload:<12} {rounds:>6} " + ",".join(f"{rates[s]:>9.1f}" for s in (*BASELINES, "Trainer")) +
              f" {ratios['hand'][0]:>19.3f} {ratios['bare'][0]:>8.3f} {ratios['bare-mx'][0]:>11.3f}"
              f" {ratios['hand'][3]:>18.3f} {ratios['bare'][3]:>8.3f} {ratios['bare-mx'][3]:>11.3f} " +
              ",".join(f"{host[s]:>9.1f}" for s in (*BASELINES, "Trainer")))


BASELINES = ("hand", "bare", "bare-mx")


if __name__ == "__main__":
    main()

"""Data-parallel throughput on this machine: 1 rank vs 2 ranks, and the share of gradient communication.

    python bench/distributed.py                 # both workloads, 1 and 2 ranks
    python bench/distributed.py --steps 60

Each workload trains the same MLP on the same global batch with ``DistributedTrainer``: one
process (OpenBLAS with every core), then two processes launched by ``mlx.launch`` on 127.0.0.1
(one BLAS thread each). Throughput is global samples per second over the timed steps (after
warm-up). The communication share is measured, not guessed: the same ranks also train with the
gradient all-reduce taken out of the compiled step, and ``1 - t(without) / t(with)`` is the
share of step time the all-reduce costs. ``estimate`` is what the trainer reports as
``time_comm`` (an all-reduce of the gradient's size, timed at start-up) over the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = {  # name: (input features, hidden sizes, classes, global batch)
    "small MLP (0.1M params)": (64, [256], 10, 256),
    "large MLP (3.4M params)": (784, [2048, 1024], 10, 256),
}


def worker(args) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    import mlx_train  # noqa: F401
    from mlx_train.training import Callback, DistributedTrainer
    from mlx_train.training.step import Reduction

    features, hidden, classes, batch = WORKLOADS[args.workload]
    rng = np.random.default_rng(0)
    n = batch * (args.steps + args.warmup) * 2
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int32)

    no_comm = Reduction(lambda grads, n_items: (grads, n_items))  # each rank keeps its own gradient

    class Clock(Callback):
        def __init__(self):
            self.times = []

        def on_batch_end(self, trainer, step):
            self.times.append(time.perf_counter())

    def timed(comm: bool):
        dims = [features] + hidden + [classes]
        mx.random.seed(0)
        layers = []
        for a, b in zip(dims[:-1], dims[1:], strict=True):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        world = mx.distributed.init().size()
        trainer = DistributedTrainer(model, optim.Adam(1e-3), batch_size=batch // world, num_workers=0,
                                     max_steps=args.steps + args.warmup, report_every="100000 steps",
                                     eval_every="1000 epochs")
        if not comm and world > 1:
            trainer.gradient_reduction = no_comm
        clock = Clock()
        trainer.train((x, y), epochs=1, callbacks=[clock])
        seconds = clock.times[-1] - clock.times[args.warmup - 1]
        return seconds / args.steps, trainer.comm_seconds, world, trainer.is_main

    with_comm, estimate, world, main = timed(True)
    without, _, _, _ = timed(False)
    if main:
        with open(args.out, "w") as file:
            json.dump({"world": world, "step": with_comm, "step_no_comm": without, "estimate": estimate,
                       "batch": batch}, file)


def launch(workload: str, ranks: int, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--workload", workload, "--out", out,
                   "--steps", str(steps), "--warmup", str(warmup)]
        env = dict(os.environ)
        if ranks == 1:
            subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        else:
            env["OPENBLAS_NUM_THREADS"] = "1"
            launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
            subprocess.run([launcher, "-n", str(ranks), "--"] + command, check=True, env=env, stdin=subprocess.PIPE,
                           stdout=subprocess.DEVNULL)
        with open(out) as file:
            return json.load(file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is shown")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"{'workload':<26} {'ranks':>5} {'global batch':>12} {'steps/s':>8} {'samples/s':>10} {'vs 1 rank':>9} "
          f"{'comm share':>10} {'estimate':>9}")
    for workload in WORKLOADS:
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for _ in range(args.rounds):
            for ranks in (1, 2):
                runs[ranks].append(launch(workload, ranks, args.steps, args.warmup))
        base = None
        for ranks in (1, 2):
            step = statistics.median(r["step"] for r in runs[ranks])
            no_comm = statistics.median(r["step_no_comm"] for r in runs[ranks])
            estimate = statistics.median(r["estimate"] for r in runs[ranks])
            batch = runs[ranks][0]["batch"]
            rate = batch / step
            base = base or rate
            share = max(0.0, 1 - no_comm / step) if ranks > 1 else 0.0
            print(f"{workload:<26} {ranks:>5} {batch:>12} {1 / step:>8.1f} {rate:>10.0f} {rate / base:>8.2f}x "
                  f"{share:>9.0%} {min(estimate / step, 1.0):>8.0%}")


if __name__ == "__main__":
    main()

"""What the per-step stop vote of distributed training costs: 2 ranks, with and without it.

    python bench/stop_vote.py                  # 3 alternating rounds of 200 timed steps
    python bench/stop_vote.py --steps 400 --rounds 5

After every step each rank of a ``DistributedTrainer`` votes whether a stop signal (SIGTERM,
SIGINT) arrived anywhere, so that every rank stops at the same step. ``voted``: the Trainer's
vote, summed with the gradients in the step's all-reduce and read after the step; ``blocking``:
an ``all_sum`` of its own after each step (what the Trainer did before); ``without``: no vote.
The same ranks train the same MLP in each way per round (rounds start with each way in turn), on
127.0.0.1 with ``mlx.launch`` (ring backend, one BLAS thread each). The table shows the median
step time of each and the ratios.
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

VARIANTS = ("voted", "blocking", "without")
WORKLOADS = {"tiny MLP (digits-sized, batch 64)": (64, [64], 10, 64),
             "small MLP (0.1M params, batch 256)": (64, [256], 10, 256)}


def worker(args) -> None:
    import mlx_train  # noqa: F401  (before mlx.core: loads the optimized BLAS)

    # isort: split
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    from mlx_train.training import Callback, DistributedTrainer

    features, hidden, classes, batch = WORKLOADS[args.workload]
    rng = np.random.default_rng(0)
    n = batch * (args.steps + args.warmup) * 2
    x, y = rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, classes, n).astype(np.int32)

    class Clock(Callback):
        def __init__(self):
            self.times = []

        def on_batch_end(self, trainer, step):
            self.times.append(time.perf_counter())

    def blocking_vote(trainer, signals):  # what each step did before: wait for this step's vote
        from mlx_train.training.oom import any_rank

        trainer._voted_stop = any_rank(signals.requested is not None, trainer.group)
        return trainer._voted_stop

    def timed(vote: str) -> tuple[float, bool]:
        mx.random.seed(0)
        model = nn.Sequential(nn.Linear(features, hidden[0]), nn.ReLU(), nn.Linear(hidden[0], classes))
        world = mx.distributed.init().size()
        trainer = DistributedTrainer(model, optim.Adam(1e-3), batch_size=batch // world, num_workers=0,
                                     max_steps=args.steps + args.warmup, report_every="100000 steps",
                                     eval_every="1000 epochs")
        if vote == "without":
            trainer._vote_stop = lambda signals: None  # every rank alike: no collective is left unmatched
        elif vote == "blocking":
            trainer._vote_stop = lambda signals: blocking_vote(trainer, signals)
        clock = Clock()
        trainer.train((x, y), epochs=1, callbacks=[clock])
        return (clock.times[-1] - clock.times[args.warmup - 1]) / args.steps, trainer.is_main

    result = {}
    for round_ in range(args.rounds):  # each round starts with another variant: no order effect
        for vote in VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]:
            seconds, main = timed(vote)
            result.setdefault(vote, []).append(seconds)
    if main:
        with open(args.out, "w") as file:
            json.dump(result, file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is shown")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(f"{'workload':<36} {'voted':>9} {'blocking':>9} {'without':>9} {'voted/without':>14} "
          f"{'blocking/without':>17}   (median step time, 2 ranks)")
    for workload in WORKLOADS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            command = [sys.executable, os.path.abspath(__file__), "--worker", "--workload", workload, "--out", out,
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
            launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
            subprocess.run([launcher, "-n", "2", "--"] + command, check=True, stdin=subprocess.PIPE,
                           stdout=subprocess.DEVNULL, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
            with open(out) as file:
                result = json.load(file)
        voted, blocking, without = (statistics.median(result[variant]) for variant in VARIANTS)
        print(f"{workload:<36} {voted * 1e3:>6.2f} ms {blocking * 1e3:>6.2f} ms {without * 1e3:>6.2f} ms "
              f"{voted / without:>14.3f} {blocking / without:>17.3f}")


if __name__ == "__main__":
    main()

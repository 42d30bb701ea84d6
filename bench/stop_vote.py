"""What agreeing costs in a 2-rank data-parallel step: the ranks' votes with and without a collective of their own.

    python bench/stop_vote.py                            # 3 alternating rounds of 200 timed steps
    python bench/stop_vote.py --steps 400 --rounds 5
    python bench/stop_vote.py --baseline /tmp/main/src   # and the Trainer of another source tree, alongside

After every step the ranks of a data-parallel run agree on whether a stop signal (SIGTERM, SIGINT)
arrived anywhere and whether a rank ran out of memory, so that every rank stops at the same step and
retries a step alike. ``voted``: the Trainer as it is (the votes summed with the gradients in the
step's all-reduce, and read once after it); ``blocking``: the stop vote also as an ``all_sum`` of its
own after each step; ``without``: the stop vote not read. With ``--baseline SRC`` each round also
trains, in its own ranks, the Trainer of the source tree ``SRC`` (``voted`` there: whatever that
code does), and the table adds its step time and the ratio ``voted / baseline``.

The same ranks train the same MLP in each way per round, on 127.0.0.1 with ``mlx.launch`` (ring
backend, one BLAS thread each); rounds start with each way in turn, and the baseline's ranks run
before this tree's in every other round. The table shows the median step time of each (over the
rounds; each round's is its mean step time after warm-up) and the median of the per-round ratios.
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

    from mlx_train.distributed.topology import DataParallel, any_rank, init_group
    from mlx_train.training import Callback, Trainer

    features, hidden, classes, batch = WORKLOADS[args.workload]
    rng = np.random.default_rng(0)
    n = batch * (args.steps + args.warmup) * 2
    x, y = rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, classes, n).astype(np.int32)
    group = init_group("any")

    class Blocking(DataParallel):  # what each step did before the vote joined the all-reduce
        def vote_stop(self, requested):
            super().vote_stop(requested)
            return any_rank(requested, self.group)

    class Without(DataParallel):  # every rank alike: no collective is left unmatched
        def vote_stop(self, requested):
            return None

    class Clock(Callback):
        def __init__(self):
            self.times = []

        def on_batch_end(self, trainer, step):
            self.times.append(time.perf_counter())

    topologies = {"voted": DataParallel, "blocking": Blocking, "without": Without}

    def timed(variant: str) -> float:
        mx.random.seed(0)
        model = nn.Sequential(nn.Linear(features, hidden[0]), nn.ReLU(), nn.Linear(hidden[0], classes))
        trainer = Trainer(model, optim.Adam(1e-3), topology=topologies[variant](group),
                          batch_size=batch // group.size(), num_workers=0, max_steps=args.steps + args.warmup,
                          report_every="100000 steps", eval_every="1000 epochs")
        clock = Clock()
        trainer.train((x, y), epochs=1, callbacks=[clock])
        return (clock.times[-1] - clock.times[args.warmup - 1]) / args.steps

    variants = args.variants.split(",")
    start = args.round % len(variants)
    result = {variant: timed(variant) for variant in variants[start:] + variants[:start]}
    if group.rank() == 0:
        with open(args.out, "w") as file:
            json.dump(result, file)


def launch(args, workload: str, variants: tuple[str, ...], round_: int, source: str | None) -> dict[str, float]:
    """One round of ``variants`` on 2 ranks (with ``source`` first on their path)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--workload", workload, "--out", out,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--round", str(round_),
                   "--variants", ",".join(variants)]
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        if source is not None:
            env["PYTHONPATH"] = os.path.abspath(source)
        launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
        subprocess.run([launcher, "-n", "2", "--"] + command, check=True, stdin=subprocess.PIPE,
                       stdout=subprocess.DEVNULL, env=env)
        with open(out) as file:
            result: dict[str, float] = json.load(file)
            return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is shown")
    parser.add_argument("--baseline", default=None, help="a source tree (the directory holding mlx_train) whose "
                        "Trainer runs alongside, in the same rounds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    columns = [*VARIANTS, *(["baseline"] if args.baseline else [])]
    ratios = ["voted/without", "blocking/without", *(["voted/baseline"] if args.baseline else [])]
    print(f"{'workload':<36} " + " ".join(f"{c:>9}" for c in columns) + " " +
          " ".join(f"{r:>16}" for r in ratios) + "   (median step time, 2 ranks)")
    for workload in WORKLOADS:
        rounds: list[dict[str, float]] = []
        for round_ in range(args.rounds):
            timings = {}
            sides = [(VARIANTS, here)] + ([(("voted",), args.baseline)] if args.baseline else [])
            for variants, source in sides if round_ % 2 == 0 else sides[::-1]:
                result = launch(args, workload, variants, round_, source)
                timings.update(result if source == here else {"baseline": result["voted"]})
            rounds.append(timings)
        medians = {c: statistics.median(r[c] for r in rounds) for c in columns}
        per_round = {ratio: statistics.median(r[ratio.split("/")[0]] / r[ratio.split("/")[1]] for r in rounds)
                     for ratio in ratios}
        print(f"{workload:<36} " + " ".join(f"{medians[c] * 1e3:>6.2f} ms" for c in columns) + " " +
              " ".join(f"{per_round[r]:>16.3f}" for r in ratios))


if __name__ == "__main__":
    main()

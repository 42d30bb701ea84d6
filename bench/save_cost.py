"""Save cost over a long run: does a checkpoint save get slower as epochs accumulate?

A tiny MLP trains for thousands of short epochs (a few steps each) and saves a checkpoint at the
end of every epoch (``checkpoint_every="1 epochs"``, the background writer included). Throughput
of the first 10% of steps is compared with the last 10%: when what a save writes grows with the
epochs already run (the whole per-epoch history in ``trainer_state.json``), the last steps are
slower. A window's steps/s is the steps of an epoch over the median time of its epochs (each with
one save), so that other processes on a shared machine move it little. The size of the last
checkpoint's ``trainer_state.json`` is printed too.

``--baseline SRC`` runs the same measurement again with another mlx-train source tree first on
``PYTHONPATH`` (e.g. the main branch's ``src``), in a fresh process, and prints both side by side.

    python bench/save_cost.py                                  # about a minute on two CPU cores
    python bench/save_cost.py --epochs 3000 --baseline ../main/src --dir /dev/shm
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def measure(epochs: int, samples: int, batch_size: int, where: str | None = None) -> dict[str, float]:
    """Train, saving every epoch; returns steps/s of the first and last 10% of steps and the state size."""
    import mlx_train  # noqa: F401  (loads the optimized BLAS before mlx.core)

    # isort: split
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    from mlx_train.training import Callback, Trainer

    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 16)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    times: list[float] = []

    class Clock(Callback):
        def on_batch_end(self, trainer: Trainer, step: int) -> None:
            times.append(time.perf_counter())

    with tempfile.TemporaryDirectory(dir=where) as directory:
        trainer = Trainer(model, optim.SGD(0.05), batch_size=batch_size, num_workers=0, report_every="1000000 steps",
                          checkpoint_every="1 epochs", keep_last=2, seed=0)
        with contextlib.redirect_stdout(io.StringIO()):  # one progress line per epoch
            trainer.train((x, y), epochs=epochs, checkpoint_dir=directory, callbacks=[Clock()])
        last = sorted(n for n in os.listdir(directory) if n.startswith("step-"))[-1]
        state_bytes = os.path.getsize(os.path.join(directory, last, "trainer_state.json"))
    per_epoch = samples // batch_size
    ends = times[per_epoch - 1::per_epoch]  # the last step of each epoch; the save follows it
    durations = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    tenth = len(durations) // 10
    return {"steps": len(times), "first": per_epoch / statistics.median(durations[:tenth]),
            "last": per_epoch / statistics.median(durations[-tenth:]), "state_bytes": state_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2000)
    parser.add_argument("--samples", type=int, default=64, help="samples per epoch")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dir", help="where the checkpoints go (default: the system's temporary directory; "
                        "/dev/shm leaves out the disk's fsync times, which vary from save to save)")
    parser.add_argument("--baseline", metavar="SRC", help="another mlx-train src directory to compare with")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one result as JSON (--baseline)
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.epochs, args.samples, args.batch_size, args.dir)))
        return
    rows = []
    runs = ([("baseline", args.baseline)] if args.baseline else []) + [("this tree", None)]
    for name, src in runs:
        env = dict(os.environ)
        if src:
            env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
        command = [sys.executable, __file__, "--json", "--epochs", str(args.epochs), "--samples", str(args.samples),
                   "--batch-size", str(args.batch_size)] + (["--dir", args.dir] if args.dir else [])
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
        rows.append((name, json.loads(out.strip().splitlines()[-1])))
    print(f"{args.epochs} epochs x {args.samples // args.batch_size} steps, a checkpoint saved every epoch")
    print(f"{'code':12s} {'steps':>7s} {'first 10% steps/s':>18s} {'last 10% steps/s':>17s} {'last/first':>10s} "
          f"{'trainer_state.json':>18s}")
    for name, r in rows:
        print(f"{name:12s} {r['steps']:7d} {r['first']:18.1f} {r['last']:17.1f} {r['last'] / r['first']:10.3f} "
              f"{r['state_bytes'] / 1024:15.1f} KB")


if __name__ == "__main__":
    main()

"""A small DistributedTrainer run for the recovery tests: synthetic data, an MLP, a global batch of 32.

    mlx.launch -n 2 -- python ranked_run.py OUT_DIR [--max-steps N] [--kill-rank R --kill-step K] ...

Faults are injected on the first attempt only (MLX_TRAIN_ATTEMPT unset or 0): ``--kill-rank``
SIGKILLs that rank after step K, ``--stop-rank`` SIGSTOPs it (a frozen process), ``--perturb-rank``
adds 1e-3 to its weights (ranks out of sync), ``--busy-rank`` keeps its main thread busy in Python
for ``--busy-seconds`` (a long validation or checkpoint: alive, but not stepping). Rank 0
writes OUT_DIR/params.safetensors at the end; with --every-rank each rank writes
OUT_DIR/params-rank<r>.safetensors.
"""

import argparse
import os
import signal
import time

import mlx_train  # noqa: F401  (before mlx.core: loads the optimized BLAS)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mlx_train.training import Callback, DistributedTrainer


def data(n=1024, features=16, classes=4):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = (x @ rng.standard_normal((features, classes))).argmax(axis=1).astype(np.int32)
    return x, y


class Faults(Callback):
    def __init__(self, args):
        self.args = args
        self.first_attempt = os.environ.get("MLX_TRAIN_ATTEMPT", "0") == "0"

    def on_batch_end(self, trainer, step):
        a, rank = self.args, trainer.group.rank()
        if not self.first_attempt:
            return
        if a.kill_rank == rank and a.kill_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.stop_rank == rank and a.stop_step == step:
            os.kill(os.getpid(), signal.SIGSTOP)
        if a.busy_rank == rank and a.busy_step == step:
            end = time.monotonic() + a.busy_seconds
            while time.monotonic() < end:
                sum(range(10_000))
        if a.perturb_rank == rank and a.perturb_step == step:
            trainer.model.update(tree_map(lambda p: p + 1e-3, trainer.model.parameters()))
            mx.eval(trainer.model.parameters())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--max-steps", type=int, default=24)
    parser.add_argument("--checkpoint-every", default="4 steps")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--checksum-every", type=int, default=None)
    parser.add_argument("--checksum-action", default="raise")
    parser.add_argument("--every-rank", action="store_true")
    parser.add_argument("--strategy", default="data_parallel")
    parser.add_argument("--busy-seconds", type=float, default=0.0)
    for fault in ("kill", "stop", "perturb", "busy"):
        parser.add_argument(f"--{fault}-rank", type=int, default=None)
        parser.add_argument(f"--{fault}-step", type=int, default=None)
    args = parser.parse_args()

    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    world = mx.distributed.init().size()
    trainer = DistributedTrainer(
        model, optim.Adam(1e-2), strategy=args.strategy, batch_size=args.global_batch // world,
        max_steps=args.max_steps,
        checkpoint_every=args.checkpoint_every, report_every="4 steps", num_workers=0, seed=3,
        collective_timeout=args.timeout, checksum_every=args.checksum_every, checksum_action=args.checksum_action,
        keep_last=10, eval_every="100 epochs",
    )
    trainer.train(data(), epochs=100, checkpoint_dir=args.checkpoint_dir, callbacks=[Faults(args)],
                  resume=args.resume)
    params = dict(tree_flatten(model.parameters()))
    if args.every_rank:
        mx.save_safetensors(os.path.join(args.out, f"params-rank{trainer.group.rank()}.safetensors"), params)
    if trainer.is_main:
        mx.save_safetensors(os.path.join(args.out, "params.safetensors"), params)


if __name__ == "__main__":
    main()

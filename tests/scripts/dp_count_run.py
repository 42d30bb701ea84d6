"""What each step of a data-parallel run communicates and reads, counted through public seams.

    mlx.launch -n 2 -- python dp_count_run.py OUT.json [--accumulation A] [--steps N]

Collectives made outside the compiled step are listed by ``recording_collectives`` (every collective
of the library goes through ``mlx_train.distributed.collectives``); those inside it are counted per
micro-batch by a ``StepCommunication`` observing the step (traced from the step's own code); host
reads of the ranks' votes by ``Votes.reads``. Rank 0 writes, per step: ``outside`` (collectives made
outside the compiled step), ``inside`` (the collectives inside it, as [op, size]), ``reads``.
"""

import argparse
import json

import mlx_train  # noqa: F401  (before mlx.core: loads the optimized BLAS)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from mlx_train.distributed.collectives import recording_collectives
from mlx_train.distributed.comm import StepCommunication
from mlx_train.training import Callback, DistributedTrainer


class PerStep(Callback):
    """Records, after each step, what the step made and read."""

    def __init__(self, seen):
        self.seen, self.rows, self.comm, self._last = seen, [], None, (0, 0)

    def on_fit_start(self, trainer):
        self.comm = StepCommunication(trainer.group)
        trainer.memory_guard.observe(self.comm)  # counts every micro-batch, traces each new one
        self._last = (len(self.seen), trainer.gradient_reduction.votes.reads)

    def on_batch_end(self, trainer, step):
        outside, reads = len(self.seen), trainer.gradient_reduction.votes.reads
        inside = [[c.op, int(np.prod(c.shape))] for key, n in self.comm.tally.items() for _ in range(n)
                  for c in self.comm.calls[key]]
        self.comm.tally = {}
        self.rows.append({"step": step, "outside": outside - self._last[0], "inside": inside,
                          "reads": reads - self._last[1]})
        self._last = (outside, reads)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((1024, 16)).astype(np.float32), rng.integers(0, 4, 1024).astype(np.int32)
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with recording_collectives() as seen:
        trainer = DistributedTrainer(model, optim.Adam(1e-3), batch_size=32, num_workers=0, max_steps=args.steps,
                                     gradient_accumulation=args.accumulation, report_every="1000 steps",
                                     eval_every="1000 epochs")
        per_step = PerStep(seen)
        trainer.train((x, y), epochs=1, callbacks=[per_step])
    if trainer.is_main:
        parameters = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
        with open(args.out, "w") as file:
            json.dump({"parameters": parameters, "steps": per_step.rows}, file)


if __name__ == "__main__":
    main()

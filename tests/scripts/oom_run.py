"""Out-of-memory recovery in a data-parallel run: one rank fails, every rank takes the same decision.

    mlx.launch -n 2 -- python oom_run.py OUT_DIR [--fail RANK:STEP[:late]]... [--budget-rank R [--budget B]]

A global batch of 32 (per rank: 32 / world). ``--fail R:K`` makes rank R's step K fail with MLX's
allocation error after its update was dispatched, before the gradient exchange ran (as when every
rank runs out at the same point); ``R:K:late`` after the step was evaluated (the update ran out of
memory after the exchange, on that rank alone). ``--budget-rank`` gives that rank alone a
memory_limit it cannot meet: by default just above the weights, gradients and Adam state (so no step fits);
``--budget BYTES`` another one (below those, it is refused before the first step).
Each rank writes OUT_DIR/params-rank<r>.safetensors and OUT_DIR/events-rank<r>.json.
"""

import argparse
import json
import os

import mlx_train  # noqa: F401  (before mlx.core: loads the optimized BLAS)

# isort: split
import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.testing import SimulatedOutOfMemory
from mlx_train.training import DistributedTrainer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fail", action="append", default=[], metavar="RANK:STEP[:late]")
    parser.add_argument("--budget-rank", type=int, default=-1)
    parser.add_argument("--budget", type=int, help="bytes (default: just above what training holds)")
    args = parser.parse_args()
    data = load_dataset("digits", seed=0)
    mx.random.seed(0)
    model = build_model("mlp", data["info"], hidden_dims=[64])
    trainer = DistributedTrainer(model, optim.Adam(1e-3), strategy="data_parallel", report_every="1000 steps",
                                 max_steps=6, seed=5, num_workers=0, eval_every="1000 steps")
    rank, world = trainer.group.rank(), trainer.group.size()
    held = 4 * sum(v.nbytes for _, v in tree_flatten(model.parameters()))  # weights, gradients, Adam's moments
    budget = (args.budget or held + 1000) if rank == args.budget_rank else None  # by default below any step
    trainer.config = trainer.config.replace(batch_size=32 // world, memory_limit=budget)
    callbacks = []
    for fail in args.fail:
        fail_rank, step, *late = fail.split(":")
        if int(fail_rank) == rank:
            callbacks.append(SimulatedOutOfMemory([int(step)], evaluated=bool(late)))
    try:
        trainer.train(data["train"], epochs=1, callbacks=callbacks)
        outcome = "finished"
    except Exception as error:  # noqa: BLE001 - reported to the test
        outcome = f"{type(error).__name__}: {error}"
    os.makedirs(args.out, exist_ok=True)
    mx.save_safetensors(os.path.join(args.out, f"params-rank{rank}.safetensors"),
                        dict(tree_flatten(model.parameters())))
    with open(os.path.join(args.out, f"events-rank{rank}.json"), "w") as file:
        json.dump({"outcome": outcome, "step": trainer.step, "events": trainer.memory_guard.events,
                   "batch_size": trainer.memory_guard.batch_size}, file)


if __name__ == "__main__":
    main()

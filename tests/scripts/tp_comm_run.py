"""A short tensor-parallel run of the tiny llama whose report rows the communication tests read.

    python tp_comm_run.py OUT_DIR [--mode full|lora] [--length T] [--accumulation K] [--max-grad-norm X]
    mlx.launch -n 2 -- python tp_comm_run.py OUT_DIR [...]     # strategy="tensor_parallel"
    ... --data-parallel                                        # strategy="data_parallel" instead

Trains 4 steps of batch 8 on random tokens (sequences of ``--length``), reporting every step; rank 0 writes
OUT_DIR/rows.json (every report's logs) and the run directory OUT_DIR/run (metrics.jsonl, heartbeats).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import llm_tiny  # noqa: E402  (imports mlx_train first: BLAS preload)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402

from mlx_train.llm import tensor_parallel as llm_tensor_parallel  # noqa: E402
from mlx_train.llm.adapters import AdapterConfig, apply_adapters  # noqa: E402
from mlx_train.training import Callback, DistributedTrainer, Trainer  # noqa: E402

VOCAB, STEPS, BATCH = 96, 4, 8


def lm(model, inputs, targets):
    return nn.losses.cross_entropy(model(inputs), targets).mean()


class Rows(Callback):
    def __init__(self):
        self.rows = []

    def on_report(self, trainer, logs):
        self.rows.append(dict(logs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=["lora", "full"], default="full")
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--max-grad-norm", type=float, default=None)
    parser.add_argument("--data-parallel", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    group = mx.distributed.init()
    model, _ = llm_tiny.make_model(VOCAB, seed=0)
    spec = AdapterConfig(args.mode, num_layers=2, rank=4, scale=2.0)
    if group.size() > 1 and not args.data_parallel:
        llm_tensor_parallel.shard_for_finetune(model, spec, group)
    else:
        apply_adapters(model, spec)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH * STEPS, args.length + 1)).astype(np.int32)
    rows = Rows()
    options = dict(loss_fn=lm, batch_size=BATCH // args.accumulation, gradient_accumulation=args.accumulation,
                   max_steps=STEPS, report_every="1 steps", num_workers=0, seed=0, max_grad_norm=args.max_grad_norm,
                   collective_timeout=60, eval_every="100 epochs", run_dir=os.path.join(args.out, "run"))
    if group.size() > 1:
        strategy = "data_parallel" if args.data_parallel else "tensor_parallel"
        trainer = DistributedTrainer(model, optim.Adam(1e-3), strategy=strategy, **options)
    else:
        trainer = Trainer(model, optim.Adam(1e-3), **options)
    trainer.train((tokens[:, :-1], tokens[:, 1:]), epochs=1, callbacks=[rows])
    if group.rank() == 0:
        with open(os.path.join(args.out, "rows.json"), "w") as f:
            json.dump(rows.rows, f)


if __name__ == "__main__":
    main()

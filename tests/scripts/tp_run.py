"""Tensor-parallel run for the equivalence and resume tests: a tiny mlx-lm llama, LoRA, DoRA or full.

    python tp_run.py OUT_DIR MODE [--max-grad-norm X]               # one process, the plain Trainer
    mlx.launch -n 2 -- python tp_run.py OUT_DIR MODE [...]         # strategy="tensor_parallel"

Writes OUT_DIR/losses.json (loss and gradient norm of every step this attempt ran),
OUT_DIR/trained.safetensors (the trained parameters, gathered whole) and OUT_DIR/adapters (mlx-lm's
adapter format, gathered); every rank writes OUT_DIR/rank-<r>.json (its shapes, the replicated
check). ``--checkpoint-dir`` saves every 5 steps; ``--kill-rank R --kill-step K`` SIGKILLs rank R
after step K on the first attempt (under the supervisor).
"""

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))

import llm_tiny  # noqa: E402  (imports mlx_train first: BLAS preload)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_train.distributed import tensor  # noqa: E402
from mlx_train.llm import tensor_parallel as llm_tensor_parallel  # noqa: E402
from mlx_train.llm.adapters import AdapterConfig, apply_adapters, save_adapters  # noqa: E402
from mlx_train.training import Callback, DistributedTrainer, Trainer  # noqa: E402

VOCAB, STEPS, LR = 96, 20, 2e-3


def lm(model, inputs, targets):
    return nn.losses.cross_entropy(model(inputs), targets).mean()


class Record(Callback):
    def __init__(self, kill_rank, kill_step):
        self.values, self.norms = [], []
        self.kill = (kill_rank, kill_step) if os.environ.get("MLX_TRAIN_ATTEMPT", "0") == "0" else None

    def on_report(self, trainer, logs):
        self.values.append(logs["loss"])
        self.norms.append(logs.get("grad_norm"))

    def on_batch_end(self, trainer, step):
        rank = trainer.group.rank() if trainer.group is not None else 0
        if self.kill == (rank, step):
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode", choices=["lora", "dora", "full"])
    parser.add_argument("--max-grad-norm", type=float, default=None)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-step", type=int, default=None)
    parser.add_argument("--resume", default=None, help="one process: resume a tensor-parallel run's checkpoint")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    group = mx.distributed.init()
    model, _ = llm_tiny.make_model(VOCAB, seed=0)
    spec = AdapterConfig(args.mode, num_layers=2, rank=4, scale=2.0)
    if group.size() > 1:
        llm_tensor_parallel.shard_for_finetune(model, spec, group)
    else:
        apply_adapters(model, spec)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(160, 17)).astype(np.int32)
    record = Record(args.kill_rank, args.kill_step)
    options = dict(loss_fn=lm, batch_size=8 // args.accumulation, gradient_accumulation=args.accumulation,
                   max_steps=STEPS, report_every="1 steps", num_workers=0, seed=0,
                   max_grad_norm=args.max_grad_norm, collective_timeout=60, checkpoint_every="5 steps",
                   keep_last=2, eval_every="100 epochs")
    if group.size() > 1 or args.resume:
        trainer = DistributedTrainer(model, optim.Adam(LR), strategy="tensor_parallel", **options)
    else:
        trainer = Trainer(model, optim.Adam(LR), **options)
    trainer.train((tokens[:, :-1], tokens[:, 1:]), epochs=1, callbacks=[record], checkpoint_dir=args.checkpoint_dir,
                  resume=args.resume)
    layout = tensor.shard_layout(model)
    trained = dict(tree_flatten(model.trainable_parameters()))
    whole = tensor.gather_parameters(trained, layout, group)
    adapters = os.path.join(args.out, "adapters")
    if group.size() > 1:
        llm_tensor_parallel.save_gathered_adapters(model, spec, adapters, group)
    else:
        save_adapters(model, spec, adapters)
    optimizer_state = {k: v.shape for k, v in tree_flatten(trainer.optimizer.state) if hasattr(v, "shape")}
    with open(os.path.join(args.out, f"rank-{group.rank()}.json"), "w") as f:
        json.dump({"shapes": {k: list(v.shape) for k, v in trained.items()},
                   "optimizer_shapes": {k: list(v) for k, v in optimizer_state.items()},
                   "layout": tensor.layout_record(layout)["layout"],  # {path: axis}
                   "differing": tensor.replicated_agree(model, layout, group)}, f)
    if group.rank() == 0:
        mx.save_safetensors(os.path.join(args.out, "trained.safetensors"), whole)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump({"loss": record.values, "grad_norm": record.norms}, f)


if __name__ == "__main__":
    main()

"""Tensor-parallel run for the equivalence tests: a tiny mlx-lm llama, LoRA, DoRA or full fine-tuning.

    python tp_run.py OUT_DIR MODE            # one process, the plain Trainer
    mlx.launch -n 2 -- python tp_run.py OUT_DIR MODE   # strategy="tensor_parallel"

Writes OUT_DIR/losses.json (the loss of every step) and OUT_DIR/trained.safetensors (the trained
parameters, gathered whole); every rank writes OUT_DIR/rank-<r>.json (its shapes, replicated check).
"""

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
from mlx.utils import tree_flatten  # noqa: E402

from mlx_train.distributed import tensor_parallel  # noqa: E402
from mlx_train.llm.adapters import AdapterConfig, apply_adapters  # noqa: E402
from mlx_train.training import Callback, DistributedTrainer, Trainer  # noqa: E402

VOCAB, STEPS, LR = 96, 20, 2e-3


def lm(model, inputs, targets):
    return nn.losses.cross_entropy(model(inputs), targets).mean()


class Losses(Callback):
    def __init__(self):
        self.values, self.norms = [], []

    def on_report(self, trainer, logs):
        self.values.append(logs["loss"])
        self.norms.append(logs.get("grad_norm"))


def main():
    out, mode = sys.argv[1], sys.argv[2]
    max_grad_norm = float(sys.argv[3]) if len(sys.argv) > 3 else None
    os.makedirs(out, exist_ok=True)
    group = mx.distributed.init()
    model, _ = llm_tiny.make_model(VOCAB, seed=0)
    if group.size() > 1:
        tensor_parallel.shard_model(model, group)
    apply_adapters(model, AdapterConfig(mode, num_layers=2, rank=4, scale=2.0))
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(160, 17)).astype(np.int32)
    data = (tokens[:, :-1], tokens[:, 1:])
    losses = Losses()
    options = dict(loss_fn=lm, batch_size=8, max_steps=STEPS, report_every="1 steps", num_workers=0, seed=0,
                   max_grad_norm=max_grad_norm, collective_timeout=60)
    if group.size() > 1:
        trainer = DistributedTrainer(model, optim.Adam(LR), strategy="tensor_parallel", **options)
    else:
        trainer = Trainer(model, optim.Adam(LR), **options)
    trainer.train(data, epochs=1, callbacks=[losses])
    layout = tensor_parallel.shard_layout(model)
    trained = dict(tree_flatten(model.trainable_parameters()))
    whole = tensor_parallel.gather_parameters(trained, layout, group)
    optimizer_state = {k: v.shape for k, v in tree_flatten(trainer.optimizer.state) if hasattr(v, "shape")}
    with open(os.path.join(out, f"rank-{group.rank()}.json"), "w") as f:
        json.dump({"shapes": {k: list(v.shape) for k, v in trained.items()},
                   "optimizer_shapes": {k: list(v) for k, v in optimizer_state.items()},
                   "layout": layout, "differing": tensor_parallel.replicated_agree(model, layout, group)}, f)
    if group.rank() == 0:
        mx.save_safetensors(os.path.join(out, "trained.safetensors"), whole)
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"loss": losses.values, "grad_norm": losses.norms}, f)


if __name__ == "__main__":
    main()

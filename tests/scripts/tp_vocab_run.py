"""Tensor-parallel training with the vocabulary split, for the equivalence and resume tests: a tiny mlx-lm
llama (tied embedding, or ``--untied``: a separate ``lm_head``) trained with ``lm_loss``.

    python tp_vocab_run.py OUT_DIR MODE [--untied] [--full-logits]      # one process, the plain Trainer
    mlx.launch -n 2 -- python tp_vocab_run.py OUT_DIR MODE [...]        # strategy="tensor_parallel"

MODE: ``lora``, ``full`` (the blocks) or ``all`` (every parameter: the embedding and head train too).
``--full-logits`` sets ``CHUNK_LOGITS = 0`` (the model's own call, logits gathered); otherwise the loss
runs in chunks of 32 tokens. ``--checkpoint-dir`` saves every 5 steps, ``--max-steps`` stops early,
``--resume CHECKPOINT`` continues one (on any number of ranks). Writes OUT_DIR/losses.json (this attempt's
per-step losses), OUT_DIR/trained.safetensors (the trained parameters, gathered whole) and, per rank,
OUT_DIR/rank-<r>.json (layout and shapes of its parameters).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import llm_tiny  # noqa: E402  (imports mlx_train first: BLAS preload)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_train.distributed import tensor  # noqa: E402
from mlx_train.llm import loss as llm_loss  # noqa: E402
from mlx_train.llm import tensor_parallel as llm_tensor_parallel  # noqa: E402
from mlx_train.llm.adapters import AdapterConfig, apply_adapters  # noqa: E402
from mlx_train.training import Callback, DistributedTrainer, Trainer  # noqa: E402

VOCAB, STEPS, LR = 96, 12, 2e-3


class Record(Callback):
    def __init__(self):
        self.values = []

    def on_report(self, trainer, logs):
        self.values.append(logs["loss"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode", choices=["lora", "full", "all"])
    parser.add_argument("--untied", action="store_true")
    parser.add_argument("--full-logits", action="store_true")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--max-steps", type=int, default=STEPS)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    llm_loss.CHUNK_LOGITS = 0 if args.full_logits else VOCAB * 32
    llm_loss.MIN_CHUNK_TOKENS = 32
    group = mx.distributed.init()
    model, _ = llm_tiny.make_model(VOCAB, seed=0, tie=not args.untied)
    spec = AdapterConfig("full" if args.mode == "all" else args.mode, num_layers=2, rank=4, scale=2.0)
    if group.size() > 1:
        llm_tensor_parallel.shard_for_finetune(model, spec, group)
    else:
        apply_adapters(model, spec)
    if args.mode == "all":
        model.unfreeze()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(96, 17)).astype(np.int32)
    mask = (rng.random((96, 16)) > 0.2).astype(np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}
    record = Record()
    options = dict(loss_fn=llm_loss.lm_loss, batch_size=8, max_steps=args.max_steps, report_every="1 steps",
                   num_workers=0, seed=0, collective_timeout=60, checkpoint_every="5 steps", keep_last=3,
                   eval_every="100 epochs")
    if group.size() > 1 or args.resume:
        trainer = DistributedTrainer(model, optim.Adam(LR), strategy="tensor_parallel", **options)
    else:
        trainer = Trainer(model, optim.Adam(LR), **options)
    trainer.train(data, epochs=1, callbacks=[record], checkpoint_dir=args.checkpoint_dir, resume=args.resume)
    layout = tensor.shard_layout(model)
    params = dict(tree_flatten(model.parameters()))
    whole = tensor.gather_parameters(params, layout, group)
    with open(os.path.join(args.out, f"rank-{group.rank()}.json"), "w") as f:
        json.dump({"layout": tensor.layout_record(layout)["layout"],  # {path: axis}
                   "shapes": {k: list(v.shape) for k, v in params.items()},
                   "trainable": sorted(k for k, _ in tree_flatten(model.trainable_parameters())),
                   "differing": tensor.replicated_agree(model, layout, group)}, f)
    if group.rank() == 0:
        mx.save_safetensors(os.path.join(args.out, "trained.safetensors"), whole)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump({"loss": record.values}, f)


if __name__ == "__main__":
    main()

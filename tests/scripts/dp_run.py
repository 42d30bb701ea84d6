"""Data-parallel run for the equivalence tests: global batch 32 split over the ranks.

    mlx.launch -n 2 python dp_run.py OUT.safetensors
"""

import sys

import mlx_train  # noqa: F401

# isort: split
import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.training import DistributedTrainer


def main():
    out = sys.argv[1]
    data = load_dataset("digits", seed=0)
    mx.random.seed(0)
    model = build_model("mlp", data["info"], hidden_dims=[64])
    trainer = DistributedTrainer(model, optim.Adam(1e-3), strategy="data_parallel", report_every="5 steps",
                                 max_steps=12, seed=5, num_workers=0)
    world = trainer.group.size()
    trainer.config = trainer.config.replace(batch_size=32 // world)
    trainer.train(data["train"], data["val"], epochs=1)
    if trainer.is_main:
        mx.save_safetensors(out, dict(tree_flatten(model.parameters())))


if __name__ == "__main__":
    main()

"""Train from a YAML config in the `training:` / `optimizer:` schema.

TrainConfig.from_yaml reads the file into one flat config (unknown keys are an
error that names the closest valid key); the Trainer builds the optimizer and the
learning-rate schedule from it. The same file works on the command line:

    mlx-train train --config custom_config.yaml

Needs scikit-learn for the digits (pip install 'mlx-train[examples]').

    python examples/yaml_config.py
"""

import mlx_train  # noqa: F401 — first: it loads an optimized BLAS before MLX starts (much faster on Linux)

# isort: split


from pathlib import Path

import mlx.core as mx

from mlx_train import TrainConfig
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import MLP
from mlx_train.training import Trainer

CONFIG = """\
training:
  batch_size: 32
  learning_rate: 2e-3
  num_epochs: 4                     # same as `epochs`
  early_stopping_patience: 5
  checkpoint_frequency: 2           # a checkpoint every 2 epochs
  seed: 42
  mixed_precision: false            # true = bfloat16 compute (fast on Apple GPUs, slow on a Linux CPU)
  gradient_accumulation_steps: 2

optimizer:
  name: "adamw"
  beta1: 0.9
  beta2: 0.999
  epsilon: 1e-8
  weight_decay: 0.01
"""


def main() -> dict:
    path = Path("custom_config.yaml")
    path.write_text(CONFIG)
    config = TrainConfig.from_yaml(path)
    print(f"epochs {config.epochs}, batch {config.batch_size} x {config.gradient_accumulation}, "
          f"{config.optimizer} lr {config.learning_rate}, checkpoint every {config.checkpoint_every}")

    mx.random.seed(config.seed)
    data = load_dataset("digits", seed=config.seed)
    model = MLP(in_dims=64, hidden_dims=[128], num_classes=10)
    trainer = Trainer(model, config=config)  # no optimizer given: built from the config
    # overwrite=True: running this script again starts over, moving the previous run aside.
    trainer.train(data["train"], data["val"], checkpoint_dir="checkpoints", overwrite=True)
    metrics = trainer.evaluate(data["test"])
    print(f"test accuracy: {metrics['accuracy']:.3f}")
    return metrics


if __name__ == "__main__":
    main()

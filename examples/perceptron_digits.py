"""1957: Rosenblatt's perceptron, trained on handwritten digits with mlx-train.

A perceptron is one linear layer: 64 pixel intensities in, one score per digit out.
This is the first "milestone" of a from-scratch ML course, run with mlx-train's
Trainer, DataLoader and fit(). Needs scikit-learn for the digits (pip install
'mlx-train[examples]').

    python examples/perceptron_digits.py
"""

import mlx_train  # noqa: F401 — first: it loads an optimized BLAS before MLX starts (much faster on Linux)

# isort: split


import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from mlx_train.builtin.datasets import load_dataset
from mlx_train.training import DataLoader, Trainer


class Perceptron(nn.Module):
    """One linear layer; the predicted digit is the class with the highest score."""

    def __init__(self, in_dims: int = 64, num_classes: int = 10):
        super().__init__()
        self.linear = nn.Linear(in_dims, num_classes)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear(x)


def main() -> dict:
    mx.random.seed(0)
    data = load_dataset("digits", seed=0)  # 8x8 images, flattened to 64 values in [0, 1]
    train_loader = DataLoader(data["train"], batch_size=32, shuffle=True)
    val_loader = DataLoader(data["val"], batch_size=256)

    model = Perceptron()
    # The default loss is cross-entropy for integer class targets.
    trainer = Trainer(model, optim.SGD(learning_rate=0.5), run_dir="runs/perceptron")
    # overwrite=True: running this script again starts over, moving the previous run aside.
    history = trainer.fit(train_loader, val_loader, epochs=5, save_best=True, overwrite=True)

    test = trainer.evaluate(data["test"])
    print(f"val accuracy per epoch: {[round(a, 3) for a in history['val_accuracy']]}")
    print(f"test accuracy: {test['accuracy']:.3f} (a linear model; the MLP reaches ~0.97)")
    return test


if __name__ == "__main__":
    main()

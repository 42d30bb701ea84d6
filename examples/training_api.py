"""The training API end to end: Trainer, DataLoader, callbacks, checkpoints, resume, errors.

Trains a small MLP on the digits with gradient accumulation, saves checkpoints,
stops early when validation stops improving, resumes from the newest checkpoint,
and evaluates. Needs scikit-learn for the digits (pip install 'mlx-train[examples]').

    python examples/training_api.py
"""

import mlx_train  # noqa: F401 — first: it loads an optimized BLAS before MLX starts (much faster on Linux)

# isort: split


import mlx.core as mx
import mlx.optimizers as optim

from mlx_train import DeviceConfig
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import MLP
from mlx_train.errors import DeviceError, OutOfMemoryError
from mlx_train.training import DataLoader, EarlyStopping, ModelCheckpoint, Trainer


def main() -> dict:
    mx.random.seed(0)
    data = load_dataset("digits", seed=0)  # {"train": (x, y), "val": ..., "test": ..., "info": {...}}
    train_data, val_data, test_data = data["train"], data["val"], data["test"]

    # A DataLoader batches any dataset: (x, y) arrays, dicts of arrays, or objects with __getitem__.
    loader = DataLoader(dataset=train_data, batch_size=32, shuffle=True, num_workers=2)
    x, y = next(iter(loader))
    print(f"one batch: x {x.shape}, y {y.shape}")

    model = MLP(in_dims=64, hidden_dims=[128], num_classes=10)
    hw_config = DeviceConfig(device="auto")  # the GPU when MLX has one, else the CPU
    # batch_size 32 x gradient_accumulation 4: each optimizer step sees 128 samples.
    trainer = Trainer(model=model, optimizer=optim.Adam(learning_rate=3e-3), device_config=hw_config,
                      batch_size=32, gradient_accumulation=4)

    callbacks = [
        ModelCheckpoint(filepath="best_model.safetensors", monitor="val_loss", save_best_only=True),
        EarlyStopping(monitor="val_loss", patience=3),
    ]
    try:
        # overwrite=True: running this script again starts over, moving the previous run aside
        # (checkpoints.old-<date>-<time>) instead of refusing to touch it.
        history = trainer.train(train_dataset=train_data, val_dataset=val_data, epochs=3,
                                checkpoint_dir="checkpoints", callbacks=callbacks, overwrite=True)
    except OutOfMemoryError:
        raise SystemExit("Reduce batch size or enable gradient accumulation") from None
    except DeviceError as error:
        raise SystemExit(f"Device error occurred: {error}") from None
    print(f"history: {sorted(history)}")  # train_loss, val_loss, val_accuracy, learning_rate, ...

    # A new process would do this: rebuild the model and continue from the newest checkpoint.
    mx.random.seed(0)
    resumed = Trainer(model=MLP(in_dims=64, hidden_dims=[128], num_classes=10),
                      optimizer=optim.Adam(learning_rate=3e-3), batch_size=32, gradient_accumulation=4)
    resumed.train(train_data, val_data, epochs=5, checkpoint_dir="checkpoints", resume="auto")

    metrics = resumed.evaluate(test_data)
    print(f"test: loss {metrics['loss']:.4f}, accuracy {metrics['accuracy']:.3f}")
    return metrics


if __name__ == "__main__":
    main()

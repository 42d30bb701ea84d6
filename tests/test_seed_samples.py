"""Every Python sample of the product documents runs against the package.

Each sample is the document's code, unchanged; the prelude only defines the names the
document leaves undefined (model, optimizer, datasets, hw_config, ...)."""

import textwrap

import pytest
from test_config import SEED_YAML  # the seed's YAML blocks, unchanged

PRELUDE = """
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_train import DeviceConfig
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import MLP

_data = load_dataset("digits", seed=0)
train_data, val_data, test_dataset = _data["train"], _data["val"], _data["test"]
dataset = train_data
train_dataset, val_dataset = train_data, val_data
mx.random.seed(0)
model = MLP(in_dims=64, hidden_dims=[128], num_classes=10)
optimizer = optim.Adam(learning_rate=1e-3)
hw_config = DeviceConfig(device="auto")
"""

TRAINER_SAMPLE = """
from mlx_train.training import Trainer

trainer = Trainer(
    model=model,
    optimizer=optimizer,
    device_config=hw_config,
    batch_size=32,
    gradient_accumulation=4
)

# Train for multiple epochs
trainer.train(
    train_dataset=train_data,
    val_dataset=val_data,
    epochs=10,
    checkpoint_dir="checkpoints"
)

# Evaluate model
metrics = trainer.evaluate(test_dataset)
"""

DATALOADER_SAMPLE = """
from mlx_train.training import DataLoader

loader = DataLoader(
    dataset=dataset,
    batch_size=32,
    shuffle=True,
    num_workers=4
)

for batch in loader:
    # Process batch
    loss = model(batch)
"""

CALLBACKS_SAMPLE = """
from mlx_train.training import ModelCheckpoint, EarlyStopping

callbacks = [
    ModelCheckpoint(
        filepath="best_model.pt",
        monitor="val_loss",
        save_best_only=True
    ),
    EarlyStopping(
        monitor="val_loss",
        patience=3
    )
]

trainer.train(callbacks=callbacks)
"""

DISTRIBUTED_SAMPLE = """
from mlx_train.training import DistributedTrainer

trainer = DistributedTrainer(
    model=model,
    optimizer=optimizer,
    device_config=hw_config,
    strategy="data_parallel"
)

# Train across multiple devices
trainer.train(train_dataset, val_dataset)
"""

ERRORS_SAMPLE = """
try:
    trainer.train(train_dataset, val_dataset)
except OutOfMemoryError:
    print("Reduce batch size or enable gradient accumulation")
except DeviceError as e:
    print(f"Device error occurred: {e}")
"""

FIT_SAMPLE = """
# Create trainer
trainer = Trainer(
    model=model,
    optimizer=optimizer,
    loss_fn=CrossEntropyLoss()
)

# Train for 10 epochs
history = trainer.fit(
    train_loader=train_loader,
    val_loader=val_loader,
    epochs=10,
    save_best=True
)
"""



def _run(*blocks, namespace=None):
    namespace = namespace if namespace is not None else {}
    for block in blocks:
        exec(compile(textwrap.dedent(block), "<sample>", "exec"), namespace)
    return namespace


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_trainer_callbacks_and_errors_samples(in_tmp):
    ns = _run(PRELUDE, TRAINER_SAMPLE)
    assert set(ns["metrics"]) == {"loss", "accuracy"} and ns["metrics"]["accuracy"] > 0.9
    assert any(p.name.startswith("step-") for p in (in_tmp / "checkpoints").iterdir())
    first_epochs = len(ns["trainer"].history["train_loss"])
    with pytest.warns(UserWarning, match="safetensors"):
        _run(CALLBACKS_SAMPLE, namespace=ns)
    assert len(ns["trainer"].history["train_loss"]) > first_epochs  # trained further on the same data
    assert (in_tmp / "best_model.safetensors").exists()
    ns.update(__import__("mlx_train.errors", fromlist=["*"]).__dict__)
    _run(ERRORS_SAMPLE, namespace=ns)


def test_dataloader_sample():
    ns = _run(PRELUDE, "def model(batch):\n    x, y = batch\n    return (x.sum(axis=1) * 0).sum() + y.shape[0]\n")
    _run(DATALOADER_SAMPLE, namespace=ns)
    assert float(ns["loss"].item()) > 0


def test_distributed_sample_runs_in_one_process():
    ns = _run(PRELUDE, "from mlx_train.training import Trainer\nval_dataset = val_data\n")
    ns["train_dataset"] = tuple(a[:256] for a in ns["train_data"])
    _run(DISTRIBUTED_SAMPLE, namespace=ns)
    assert ns["trainer"].group.size() == 1 and len(ns["trainer"].history["val_loss"]) == 10


def test_fit_sample_with_cross_entropy_loss(in_tmp):
    ns = _run(PRELUDE, """
from mlx_train.training import Trainer, DataLoader, CrossEntropyLoss
train_loader = DataLoader(train_data, batch_size=32)
val_loader = DataLoader(val_data, batch_size=64, shuffle=False)
""")
    _run(FIT_SAMPLE, namespace=ns)
    history = ns["history"]
    assert {"train_loss", "val_loss", "val_accuracy"} <= set(history)
    assert len(history["val_accuracy"]) == 10 and history["val_accuracy"][-1] > 0.9


def test_yaml_config_sample(in_tmp):
    (in_tmp / "custom_config.yaml").write_text(SEED_YAML)
    ns = _run("from mlx_train import TrainConfig\nconfig = TrainConfig.from_yaml('custom_config.yaml')\n")
    config = ns["config"]
    assert (config.batch_size, config.epochs, config.gradient_accumulation) == (32, 100, 8)
    assert config.learning_rate == pytest.approx(2e-5) and config.epsilon == pytest.approx(1e-8)
    assert config.precision == "bfloat16" and config.optimizer == "adamw" and config.seed == 42
    assert config.checkpoint_every == "10 epochs" and config.early_stopping_patience == 5

"""The front door: ``from mlx_train import Trainer, ...`` and what a DataLoader's batch means."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_train
import mlx_train.training
from mlx_train.training import DataLoader, Trainer


def test_training_names_import_from_the_package():
    from mlx_train import DataLoader, DistributedTrainer, EarlyStopping, ModelCheckpoint, Trainer  # noqa: F401

    names = [name for name in mlx_train.training.__all__]
    for name in names:
        assert getattr(mlx_train, name) is getattr(mlx_train.training, name), name
    assert set(names) <= set(mlx_train.__all__) and set(names) <= set(dir(mlx_train))


@pytest.mark.slow
def test_import_stays_light():
    # The CLI's help and the monitor import the package: it must not load the training stack or MLX.
    code = ("import sys, mlx_train; loaded = [m for m in ('mlx_train.training', 'mlx_train.data', 'mlx.core') "
            "if m in sys.modules]; assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)


def _parameters_after(run: str) -> dict[str, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.int32)
    mx.random.seed(0)
    model = nn.Linear(3, 2)
    # The Trainer's batch_size (5) is not the loader's (4): the loader's wins in both calls.
    trainer = Trainer(model, optim.SGD(0.5), batch_size=5, gradient_accumulation=2, report_every="1000 steps")
    loader = DataLoader((x, y), batch_size=4, shuffle=False)
    if run == "fit":
        trainer.fit(loader, epochs=2, save_best=False)
    else:
        trainer.train(loader, epochs=2)
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_fit_and_train_read_a_dataloader_batch_the_same_way():
    by_fit, by_train = _parameters_after("fit"), _parameters_after("train")
    for key in by_fit:
        np.testing.assert_allclose(by_train[key], by_fit[key], rtol=1e-6, atol=1e-7)

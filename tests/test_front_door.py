"""The front door: ``from mlx_train import Trainer, ...``."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mlx_train
import mlx_train.training


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

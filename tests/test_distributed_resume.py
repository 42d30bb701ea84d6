"""The global batch a checkpoint was trained with, kept when a run resumes on another number of
processes (the rule alone; tests/test_distributed_interrupt.py runs it with real ranks)."""

import numpy as np
import pytest

from mlx_train import TrainConfig
from mlx_train.data import DataLoader
from mlx_train.errors import ConfigError
from mlx_train.training.resume import keep_global_batch

DATA = (np.zeros((256, 4), np.float32), np.zeros(256, np.int32))


def _saved(world: int, batch: int, accumulation: int = 1) -> dict:
    return {"loader": {"batch_size": batch * accumulation, "world_size": world},
            "config": {"batch_size": batch, "gradient_accumulation": accumulation}}


def _resume(saved: dict, world: int, batch: int, accumulation: int = 1):
    lines = []
    loader = DataLoader(DATA, batch_size=batch * accumulation, num_workers=0)
    config = TrainConfig(batch_size=batch, gradient_accumulation=accumulation)
    loader, config = keep_global_batch("ckpt/step-10", saved, loader, config, world, lines.append)
    return loader.batch_size, config.gradient_accumulation, lines


def test_fewer_processes_with_the_same_batch_size_accumulate_more():
    step_batch, accumulation, lines = _resume(_saved(world=2, batch=32), world=1, batch=32)
    assert (step_batch, accumulation) == (64, 2)
    assert lines == ["gradient_accumulation 1 -> 2 to keep the global batch of 64 that ckpt/step-10 was trained with "
                     "(2 processes x batch 32 x accumulation 1) on 1 process x batch 32 x accumulation 2"]
    assert _resume(_saved(world=1, batch=16, accumulation=4), world=2, batch=16, accumulation=4)[:2] == (32, 2)


def test_settings_that_keep_the_global_batch_are_taken_as_they_are():
    assert _resume(_saved(world=2, batch=32), world=1, batch=64) == (64, 1, [])
    assert _resume(_saved(world=2, batch=32), world=1, batch=32, accumulation=2) == (64, 2, [])
    assert _resume(_saved(world=1, batch=32, accumulation=2), world=2, batch=32) == (32, 1, [])


def test_a_global_batch_that_cannot_be_kept_is_refused_with_the_settings_that_keep_it():
    with pytest.raises(ConfigError, match=r"^the number of processes cannot change on resume unless the global batch "
                       r"stays 64: ckpt/step-10 was trained with 1 process x batch_size 64 x gradient_accumulation 1 "
                       r"= 64 samples per step, and this run has 2 processes x 64 x 1 = 128, .* Keep 64 on 2 processes "
                       r"with --batch-size 32 \(with gradient_accumulation 1\); or the checkpoint's 1 process x "
                       r"batch_size 64 x gradient_accumulation 1; to train with another batch, start a new run"):
        _resume(_saved(world=1, batch=64), world=2, batch=64)
    with pytest.raises(ConfigError, match=r"^batch_size cannot change on resume .* with --set "
                       r"gradient_accumulation=4 \(with batch_size 8\); or --batch-size 32"):
        _resume(_saved(world=1, batch=32), world=1, batch=8)

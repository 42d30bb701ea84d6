"""Non-finite steps are found at the loop's next look (report, validation, checkpoint, epoch end, run end),
named exactly, never saved or kept as best; the step path itself never waits for a host read."""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train.checkpointing import CheckpointManager
from mlx_train.errors import NonFiniteError
from mlx_train.training import ModelCheckpoint, Trainer


def _data(n=64, bad=(37,)):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    x[list(bad)] = np.nan
    return x, rng.integers(0, 2, n).astype(np.int32)


def _mlp(seed=0):
    mx.random.seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _trainer(model, **options):
    return Trainer(model, optim.SGD(0.1), batch_size=8, shuffle=False, num_workers=0, **options)


def test_raise_found_at_the_next_checkpoint_names_the_step_and_saves_nothing_after_it(tmp_path):
    trainer = _trainer(_mlp(), checkpoint_every="3 steps", report_every="100 steps")
    with pytest.raises(NonFiniteError, match=r"at step 4 \(epoch 1, batch 4 of 8\); the batch's samples at "
                                             r"positions 2 hold NaN/Inf values, found at step 6\."):
        trainer.train(_data(bad=(26,)), epochs=1, checkpoint_dir=str(tmp_path))
    assert trainer.step == 6
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-00000003"]


@pytest.mark.parametrize("max_steps, found", [(5, 5), (None, 8)])
def test_raise_is_found_by_the_run_end_or_epoch_end_without_any_report_or_checkpoint(max_steps, found):
    trainer = _trainer(_mlp(), report_every="100 steps", max_steps=max_steps)
    with pytest.raises(NonFiniteError, match=rf"at step 2 \(epoch 1, batch 2 of 8\).*found at step {found}\."):
        trainer.train(_data(bad=(12,)), epochs=2)
    assert trainer.history == {}  # the epoch's end never ran on non-finite weights


def test_skip_names_every_skipped_step_and_keeps_the_weights_finite(capsys):
    model = _mlp()
    trainer = _trainer(model, nonfinite="skip", report_every="100 steps")
    history = trainer.train(_data(bad=(3, 30, 31)), epochs=1)
    out = capsys.readouterr().out
    assert "at step 1 (epoch 1, batch 1 of 8); the batch's samples at positions 3 hold" in out
    assert "at step 4 (epoch 1, batch 4 of 8); the batch's samples at positions 6, 7 hold" in out
    assert out.count("the update was skipped") == 2
    assert all(np.isfinite(np.array(v)).all() for _, v in tree_flatten(model.parameters()))
    assert np.isfinite(history["train_loss"]).all()


# found at the epoch's end, or at a report on the epoch's last step
@pytest.mark.parametrize("report_every", ["100 steps", "8 steps"])
def test_stop_found_at_the_epoch_end_keeps_no_best_weights_and_no_epoch_logs(tmp_path, report_every):
    best = tmp_path / "best.safetensors"
    trainer = _trainer(_mlp(), nonfinite="stop", report_every=report_every)
    x, y = _data(bad=(20,))
    history = trainer.train((x, y), (x[:8], y[:8]), epochs=2, checkpoint_dir=str(tmp_path / "ck"),
                            callbacks=[ModelCheckpoint(str(best))])  # saves every epoch, best or not
    assert trainer.stop_training and trainer.step == 8
    assert not best.exists()
    assert CheckpointManager(str(tmp_path / "ck")).latest() is None
    assert "train_loss" not in trainer.history or len(trainer.history["train_loss"]) == 0
    assert history is not None


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_the_step_path_makes_no_host_read(nonfinite, monkeypatch):
    """Host reads (``array.item()``/``tolist()``) per epoch do not grow with its steps: none is made per step."""
    x, y = _data(n=512, bad=())
    trainer = _trainer(_mlp(), nonfinite=nonfinite, report_every="1000 steps")
    trainer.train((x[:64], y[:64]), epochs=1)  # compiled and warmed up
    reads = []
    for name in ("item", "tolist"):
        read = getattr(mx.array, name)
        monkeypatch.setattr(mx.array, name, lambda self, read=read, name=name: reads.append(name) or read(self))
    counts = []
    for n in (256, 512):  # 32 steps, then 64
        reads.clear()
        trainer.train((x[:n], y[:n]), epochs=1)
        counts.append(len(reads))
    monkeypatch.undo()
    assert trainer.step == 8 + 32 + 64
    assert counts[0] == counts[1] < 32, f"host reads in an epoch of 32 and of 64 steps: {counts}"

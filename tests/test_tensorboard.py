"""TensorBoardLogger: event files read back with TensorBoard's own reader."""

import sys

import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # extra, in dev

from mlx_train.errors import ConfigError
from mlx_train.training import Callback, TensorBoardLogger, Trainer


class Grab(Callback):
    def __init__(self):
        self.train, self.val, self.epochs = [], [], []

    def on_report(self, trainer, logs):
        self.train.append(dict(logs))

    def on_validation_end(self, trainer, logs):
        self.val.append(dict(logs))

    def on_epoch_end(self, trainer, epoch, logs):
        self.epochs.append((trainer.step, dict(logs)))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 6)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def _trainer(**options):
    return Trainer(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)), optim.Adam(1e-2),
                   batch_size=16, report_every="3 steps", **options)


def _scalars(log_dir, tag):
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)], events.Tags()["scalars"]


def test_logged_scalars_read_back_with_tensorboard(tmp_path):
    x, y = _data()
    grab = Grab()
    _trainer(run_dir=str(tmp_path / "run")).train((x, y), (x[:32], y[:32]), epochs=2,
                                                 callbacks=[TensorBoardLogger(), grab])
    log_dir = tmp_path / "run" / "tensorboard"  # the default: RUN_DIR/tensorboard
    loss, tags = _scalars(log_dir, "train/loss")
    assert [s for s, _ in loss] == [r["step"] for r in grab.train]
    assert np.allclose([v for _, v in loss], [r["loss"] for r in grab.train])
    for key in ("learning_rate", "samples_per_second", "peak_memory_gb", "step_time", "time_data"):
        values, _ = _scalars(log_dir, f"train/{key}")
        assert np.allclose([v for _, v in values], [r[key] for r in grab.train], rtol=1e-6)
    val, _ = _scalars(log_dir, "val/loss")
    assert np.allclose([v for _, v in val], [r["val_loss"] for r in grab.val])
    accuracy, _ = _scalars(log_dir, "val/accuracy")
    assert np.allclose([v for _, v in accuracy], [r["val_accuracy"] for r in grab.val])
    epoch_loss, _ = _scalars(log_dir, "epoch/train_loss")
    expected = [(s, logs["train_loss"]) for s, logs in grab.epochs]
    assert [s for s, _ in epoch_loss] == [s for s, _ in expected]
    assert [v for _, v in epoch_loss] == pytest.approx([v for _, v in expected])
    assert "train/step" not in tags and "train/epoch" not in tags


def test_a_resumed_run_replaces_the_points_logged_after_its_checkpoint(tmp_path):
    x, y = _data()  # 8 steps per epoch: reports at 3, 6, 8 (epoch end), 9, 12, ...
    log_dir, ckpt = tmp_path / "tb", tmp_path / "ckpt"
    first = Grab()
    _trainer(max_steps=12, checkpoint_every="6 steps", keep_last=5).train(
        (x, y), epochs=3, checkpoint_dir=str(ckpt), callbacks=[TensorBoardLogger(str(log_dir)), first])
    resumed = Grab()
    _trainer(max_steps=18).train((x, y), epochs=3, checkpoint_dir=str(ckpt), resume=str(ckpt / "step-00000006"),
                                 callbacks=[TensorBoardLogger(str(log_dir)), resumed])
    loss, _ = _scalars(log_dir, "train/loss")
    assert [s for s, _ in loss] == [3, 6, 8, 9, 12, 15, 16, 18]  # 8, 9 and 12 once: from the resumed run
    assert [v for s, v in loss if s > 6] == pytest.approx([r["loss"] for r in resumed.train])
    # Resuming is exact, and so is the first report after it (it covers steps 7-8, not 1-8).
    assert [r["loss"] for r in resumed.train[:3]] == pytest.approx([r["loss"] for r in first.train[2:5]], rel=1e-6)
    assert "tokens_per_second" not in resumed.train[0]


def test_tensorboard_logger_errors(tmp_path, monkeypatch):
    x, y = _data()
    with pytest.raises(ConfigError, match=r"TensorBoardLogger\(log_dir=...\) or set run_dir"):
        _trainer().train((x, y), epochs=1, callbacks=[TensorBoardLogger()])
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with pytest.raises(ConfigError, match=r"pip install 'mlx-train\[tensorboard\]'"):
        TensorBoardLogger(str(tmp_path))

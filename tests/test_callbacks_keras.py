"""EarlyStopping and ReduceLROnPlateau mean what Keras 3's do: hand-worked metric sequences driven
straight into the callbacks, the best weights at the end of a run, and an exact resume."""

import os
import signal
import warnings

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train.config import metric_direction
from mlx_train.errors import ConfigError, TrainingInterrupted
from mlx_train.training import Callback, EarlyStopping, ReduceLROnPlateau, Trainer


class _Stub:
    """The part of a Trainer the two callbacks use."""

    def __init__(self, lr=1.0):
        self.model, self.optimizer, self.stop_training, self.messages = nn.Linear(2, 2), optim.SGD(lr), False, []

    def log(self, message):
        self.messages.append(message)


def _drive(callback, values, trainer=None, first_epoch=0, key="val_loss"):
    """Feed ``values`` as epoch logs; returns the stub trainer."""
    trainer = trainer or _Stub()
    for epoch, value in enumerate(values, start=first_epoch):
        callback.on_epoch_end(trainer, epoch, {key: value})
        if trainer.stop_training:
            break
    return trainer


def test_baseline_stops_a_run_that_improves_but_never_beats_it():
    # wait counts every monitored epoch; only an improvement that beats the baseline resets it.
    stopper = EarlyStopping(patience=2, baseline=0.5)
    _drive(stopper, [0.9, 0.8, 0.7, 0.6])
    assert stopper.stopped_epoch == 1 and stopper.best == 0.8
    plain = EarlyStopping(patience=2)
    assert not _drive(plain, [0.9, 0.8, 0.7, 0.6]).stop_training


def test_baseline_beaten_then_patience_as_usual():
    stopper = EarlyStopping(patience=2, baseline=0.5)
    _drive(stopper, [0.9, 0.4, 0.45, 0.46, 0.3])
    assert stopper.stopped_epoch == 3 and stopper.best == 0.4 and stopper.best_epoch == 1


def test_start_from_epoch_ignores_the_first_epochs():
    stopper = EarlyStopping(patience=1, start_from_epoch=2)
    _drive(stopper, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert stopper.stopped_epoch == 3 and stopper.best == 3.0 and stopper.best_epoch == 2
    plain = EarlyStopping(patience=1)
    _drive(plain, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert plain.stopped_epoch == 1


def test_early_stopping_state_resumes_exactly_with_baseline_and_start_from_epoch():
    # epoch 0 is not watched; 0.95, 0.8, 0.7 improve without beating 0.6: wait 1, 2, 3 -> stop at epoch 3.
    values = [0.9, 0.95, 0.8, 0.7, 0.65, 0.2]
    whole = EarlyStopping(patience=3, baseline=0.6, start_from_epoch=1)
    _drive(whole, values)
    first = EarlyStopping(patience=3, baseline=0.6, start_from_epoch=1)
    _drive(first, values[:2])
    second = EarlyStopping(patience=3, baseline=0.6, start_from_epoch=1)
    second.load_state_dict(first.state_dict())
    _drive(second, values[2:], first_epoch=2)
    assert whole.stopped_epoch == second.stopped_epoch == 3
    assert (whole.best, whole.wait, whole.best_epoch) == (second.best, second.wait, second.best_epoch)


class _Score(Callback):
    """Puts a made-up score into the epoch logs and keeps the weights of every epoch."""

    def __init__(self, scores):
        self.scores, self.weights = scores, []

    def on_epoch_end(self, trainer, epoch, logs):
        logs["score"] = self.scores[epoch]
        self.weights.append({k: np.array(v) for k, v in tree_flatten(trainer.model.trainable_parameters())})


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def _model():
    mx.random.seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


def _flat(model):
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_restore_best_weights_at_the_end_of_a_run_it_did_not_stop():
    score = _Score([0.1, 0.9, 0.5, 0.6])
    stopper = EarlyStopping(monitor="score", mode="max", patience=10, restore_best_weights=True)
    model = _model()
    trainer = Trainer(model, optim.SGD(0.1), batch_size=16, report_every="1000 steps")
    trainer.train(_data(), epochs=4, callbacks=[score, stopper])
    assert stopper.stopped_epoch is None and stopper.best_epoch == 1
    got = {k: v for k, v in _flat(model).items()}
    assert got.keys() == score.weights[1].keys()
    assert all(np.array_equal(got[k], score.weights[1][k]) for k in got)
    assert not all(np.array_equal(got[k], score.weights[3][k]) for k in got)  # it trained on after epoch 2


def test_mode_auto_warns_on_a_metric_it_cannot_place():
    for name in ("val_mcc", "val_kappa", "val_exact_match"):
        with pytest.warns(UserWarning, match=f"'{name}'.*mode='max' or mode='min'"):
            assert metric_direction(name) == "min"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [metric_direction(n) for n in ("val_loss", "val_accuracy", "loss", "val_f1")] == [
            "min", "max", "min", "max"]
        assert metric_direction("val_mcc", mode="max") == "max"


def test_reduce_lr_on_plateau_patience_cooldown_and_min_lr():
    reduce = ReduceLROnPlateau(factor=0.5, patience=2, cooldown=1, min_delta=0.0)
    trainer = _drive(reduce, [1.0] * 6)
    assert trainer.optimizer.learning_rate.item() == 0.25  # reduced at epochs 3 and 5
    floor = ReduceLROnPlateau(factor=0.5, patience=2, cooldown=1, min_delta=0.0, min_lr=0.3)
    trainer = _drive(floor, [1.0] * 8)
    assert trainer.optimizer.learning_rate.item() == pytest.approx(0.3)
    improving = ReduceLROnPlateau(factor=0.5, patience=1)
    assert _drive(improving, [1.0, 0.9, 0.8]).optimizer.learning_rate.item() == 1.0


class _SetLR(Callback):
    def __init__(self, epoch, lr):
        self.epoch, self.lr = epoch, lr

    def on_epoch_end(self, trainer, epoch, logs):
        if epoch == self.epoch:
            trainer.optimizer.learning_rate = self.lr


def _fit(callbacks, epochs=3):
    model = _model()
    trainer = Trainer(model, optim.SGD(0.1), batch_size=16, report_every="1000 steps")
    trainer.train(_data(), epochs=epochs, callbacks=callbacks)
    return trainer, _flat(model)


def test_reduced_learning_rate_reaches_the_compiled_step():
    # train_loss never improves by min_delta=10 after the first epoch: the rate halves after epochs 2 and 3
    # (the second halving comes after the last step).
    trainer, reduced = _fit([ReduceLROnPlateau(monitor="train_loss", factor=0.5, patience=1, min_delta=10.0)])
    assert trainer.optimizer.learning_rate.item() == pytest.approx(0.025)
    _, by_hand = _fit([_SetLR(1, 0.05)])
    _, constant = _fit([])
    assert all(np.array_equal(reduced[k], by_hand[k]) for k in reduced)
    assert not all(np.array_equal(reduced[k], constant[k]) for k in reduced)


class _SigtermAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_batch_end(self, trainer, step):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _run(tmp_path, callbacks, resume=None):
    model = _model()
    trainer = Trainer(model, optim.SGD(0.1), batch_size=16, report_every="1000 steps", run_dir=str(tmp_path),
                      checkpoint_dir=str(tmp_path / "ckpt"), seed=0)
    trainer.train(_data(), epochs=6, callbacks=callbacks, resume=resume)
    return _flat(model)


def _plateau():
    return ReduceLROnPlateau(monitor="train_loss", factor=0.5, patience=2, cooldown=1, min_delta=10.0)


def test_reduce_lr_on_plateau_resumes_bit_exact_after_an_interrupt(tmp_path):
    whole_cb = _plateau()
    whole = _run(tmp_path / "whole", [whole_cb])
    with pytest.raises(TrainingInterrupted):
        _run(tmp_path / "cut", [_plateau(), _SigtermAt(10)])  # in epoch 3, after the first reduction
    resumed_cb = _plateau()
    resumed = _run(tmp_path / "cut", [resumed_cb], resume="auto")
    assert whole_cb.state_dict() == resumed_cb.state_dict()
    assert all(np.array_equal(whole[k], resumed[k]) for k in whole)


def test_reduce_lr_on_plateau_refuses_a_schedule_and_a_factor_of_one():
    trainer = Trainer(_model(), optim.SGD(optim.cosine_decay(0.1, 100)), batch_size=16, report_every="1000 steps")
    with pytest.raises(ConfigError, match="schedule"):
        trainer.train(_data(), epochs=1, callbacks=[ReduceLROnPlateau(monitor="train_loss")])
    with pytest.raises(ConfigError, match="factor"):
        ReduceLROnPlateau(factor=1.0)

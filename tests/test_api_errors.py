"""The Python API answers a Keras user's habits with a sentence: loss names, callback signatures."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from mlx_train.errors import ConfigError
from mlx_train.training import Callback, Trainer
from mlx_train.training.callbacks import CallbackList


def _data(targets="class"):
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) if targets == "class" else x[:, :2].copy()
    return x, y


def test_a_named_loss_trains_like_the_function():
    x, y = _data("regression")
    runs = []
    for loss in ("mse", nn.losses.mse_loss):
        mx.random.seed(0)
        model = nn.Linear(4, 2)
        Trainer(model, optim.SGD(0.1), loss_fn=loss, batch_size=8, seed=0).train((x, y), epochs=2)
        runs.append(np.array(model.weight))
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.parametrize("loss, message", [
    ("msee", r"unknown loss_fn 'msee': name one of mlx\.nn\.losses \(binary_cross_entropy, .*'mse' or 'mae'"),
    ("sparse_categorical_crossentropy", r"Keras' crossentropy names expect probabilities by default"),
    (3, r"loss_fn must be a function, .* got int 3"),
])
def test_a_loss_that_is_not_a_function_or_a_known_name(loss, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(nn.Linear(4, 2), optim.SGD(0.1), loss_fn=loss)


class KerasStyle:
    def on_epoch_end(self, epoch, logs=None):
        pass


class KerasOnly:
    def on_train_begin(self, logs=None):
        pass


def test_a_keras_signature_is_refused_before_training_with_the_signature_to_write():
    x, y = _data()
    trainer = Trainer(nn.Linear(4, 2), optim.SGD(0.1), batch_size=8)
    with pytest.raises(ConfigError, match=r"callback KerasStyle\.on_epoch_end\(epoch, logs=None\) cannot take the "
                                          r"arguments mlx-train passes: on_epoch_end\(trainer, epoch, logs\).*def "
                                          r"on_epoch_end\(self, trainer, epoch, logs\)"):
        trainer.train((x, y), epochs=1, callbacks=[KerasStyle()])
    assert trainer.step == 0
    with pytest.raises(ConfigError, match=r"KerasOnly is not a callback.*on_train_begin -> on_fit_start"):
        CallbackList([KerasOnly()])


def test_callbacks_with_the_right_signature_or_flexible_ones_pass():
    class Ours(Callback):
        def on_epoch_end(self, trainer, epoch, logs):
            pass

    class Flexible:
        def on_report(self, *args, **kwargs):
            pass

    assert len(CallbackList([Ours(), Flexible()]).callbacks) == 2

"""The Python API answers a Keras user's habits with a sentence: loss names, callback signatures."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from mlx_train.errors import ConfigError, DataError
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


def test_an_optimizer_by_name_trains_like_the_object():
    x, y = _data()
    weights = []
    for optimizer in ("adam", optim.Adam(learning_rate=1e-3)):
        mx.random.seed(0)
        model = nn.Linear(4, 2)
        Trainer(model, optimizer, batch_size=8, seed=0).train((x, y), epochs=2)
        weights.append(np.array(model.weight))
    assert np.array_equal(weights[0], weights[1])


def test_an_optimizer_that_is_neither_an_object_nor_a_name():
    with pytest.raises(ConfigError, match=r"optimizer must be an mlx\.optimizers\.Optimizer .* got dict"):
        Trainer(nn.Linear(4, 2), {"lr": 1e-3})
    with pytest.raises(ConfigError, match=r"adamm"):
        Trainer(nn.Linear(4, 2), "adamm")


@pytest.mark.parametrize("epochs, message", [
    (0, r"^epochs=0 trains nothing: give epochs >= 1, or leave it out to train the config's epochs \(10\)$"),
    (-2, r"^epochs=-2 trains nothing"),
    ("3", r"^epochs must be a whole number >= 1, or None for the config's epochs \(10\); got str '3'$"),
    (2.5, r"got float 2\.5"),
])
def test_epochs_that_train_nothing_or_are_not_numbers(epochs, message):
    x, y = _data()
    trainer = Trainer(nn.Linear(4, 2), optim.SGD(0.1), batch_size=8)
    with pytest.raises(ConfigError, match=message):
        trainer.train((x, y), epochs=epochs)
    with pytest.raises(ConfigError, match=message):
        trainer.fit([(mx.array(x), mx.array(y))], epochs=epochs)
    assert trainer.step == 0
    assert len(Trainer(nn.Linear(4, 2), optim.SGD(0.1), batch_size=8).train((x, y), epochs=np.int64(1))
               ["train_loss"]) == 1  # a NumPy integer is a whole number


def test_an_all_frozen_model_is_refused_before_training():
    x, y = _data()
    model = nn.Linear(4, 2)
    model.freeze()
    with pytest.raises(ConfigError, match=r"the model \(Linear\) has no trainable parameters: every parameter is "
                                          r"frozen.*model\.unfreeze\(\)"):
        Trainer(model, optim.SGD(0.1), batch_size=8).train((x, y), epochs=1)


def test_fit_save_best_without_validation_says_no_best_model_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = _data()
    with pytest.warns(UserWarning, match=r"fit\(save_best=True\) without a val_loader keeps no best model"):
        Trainer(nn.Linear(4, 2), optim.SGD(0.1), batch_size=8).fit([(mx.array(x), mx.array(y))], epochs=1)
    assert not (tmp_path / "best_model.safetensors").exists()


def _classification(n=64):
    rng = np.random.default_rng(0)
    return rng.random((n, 4), dtype=np.float32), rng.integers(0, 2, n)


@pytest.mark.parametrize("dataset_of, message", [
    (lambda x, y: {"x": x, "y": y, "weights": np.ones(len(x), np.float32)},
     r"key\(s\) 'weights' are not read by the default loss \(it reads 'x' as inputs, 'y' as targets\)"),
    (lambda x, y: {"inputs": x, "x": x, "targets": y},
     r"key\(s\) 'x' are not read by the default loss \(it reads 'inputs' as inputs, 'targets' as targets\)"),
    (lambda x, y: (x, y, np.zeros(len(x), np.float32)),
     r"mask \(the third array of \(inputs, targets, mask\)\) is zero for every sample"),
    (lambda x, y: {"x": x, "y": y, "mask": np.zeros(len(x), np.float32)},
     r"mask \(its 'mask'\) is zero for every sample"),
])
def test_columns_the_default_loss_ignores_or_a_mask_that_trains_nothing_are_refused(dataset_of, message):
    x, y = _classification()
    model = nn.Linear(4, 2)
    before = model.weight.tolist()
    with pytest.raises(DataError, match=message):
        Trainer(model, optim.SGD(learning_rate=0.1), epochs=1, batch_size=16).train(dataset_of(x, y))
    assert model.weight.tolist() == before  # refused before a step


def test_extra_keys_in_batches_of_a_plain_iterable_are_refused_at_the_first_batch():
    x, y = _classification()
    batches = [{"x": mx.array(x[i:i + 16]), "y": mx.array(y[i:i + 16]), "id": mx.arange(16)} for i in range(0, 64, 16)]
    with pytest.raises(DataError, match=r"key\(s\) 'id' are not read"):
        Trainer(nn.Linear(4, 2), optim.SGD(learning_rate=0.1)).fit(batches, epochs=1)


def test_a_mask_that_keeps_some_samples_and_a_user_loss_reading_other_keys_still_train():
    x, y = _classification()
    mask = (np.arange(len(x)) % 2).astype(np.float32)
    history = Trainer(nn.Linear(4, 2), optim.SGD(learning_rate=0.1), epochs=1, batch_size=16).train((x, y, mask))
    assert history["train_loss"][-1] > 0

    def weighted(model, batch):
        per = nn.losses.cross_entropy(model(batch["x"]), batch["y"]) * batch["weights"]
        return per.mean()

    data = {"x": x, "y": y, "weights": np.ones(len(x), np.float32)}
    history = Trainer(nn.Linear(4, 2), optim.SGD(learning_rate=0.1), loss_fn=weighted, epochs=1,
                      batch_size=16).train(data)
    assert history["train_loss"][-1] > 0


def test_model_checkpoint_into_a_folder_that_cannot_be_made_is_refused_before_training(tmp_path):
    from mlx_train.training import ModelCheckpoint

    (tmp_path / "taken").write_text("a file where the folder would go")
    x, y = _classification()
    model = nn.Linear(4, 2)
    before = model.weight.tolist()
    with pytest.raises(ConfigError, match=r"ModelCheckpoint's filepath .*taken/best\.safetensors: its folder .* "
                                          r"cannot be made"):
        Trainer(model, optim.SGD(learning_rate=0.1), epochs=1, batch_size=16).train(
            (x, y), callbacks=[ModelCheckpoint(str(tmp_path / "taken" / "best.safetensors"))])
    assert model.weight.tolist() == before
    Trainer(nn.Linear(4, 2), optim.SGD(learning_rate=0.1), epochs=2, batch_size=16).train(
        (x, y), callbacks=[ModelCheckpoint(str(tmp_path / "e{epoch}" / "m.safetensors"))])
    assert sorted(p.name for p in tmp_path.glob("e*")) == ["e1", "e2"]  # a placeholder folder is made at the save

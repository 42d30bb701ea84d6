"""EMA of the weights: the average matches a hand computation step by step, validation uses it
(val_loss equals evaluating the averaged weights by hand), export helpers, masking with pruning,
and exact resume (in process here; SIGKILL with pruning in test_pruning.py)."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train import ConfigError
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.training import EMA, Callback, Pruning, Trainer
from mlx_train.training.ema import checkpoint_ema_weights


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


def _quiet(**kwargs):
    return {"report_every": "1000 steps", **kwargs}


def _flat(model):
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


class Record(Callback):
    """Keeps the weights after every step (and before the first)."""

    def __init__(self):
        self.weights = []

    def on_fit_start(self, trainer):
        self.weights.append(_flat(trainer.model))

    def on_batch_end(self, trainer, step):
        self.weights.append(_flat(trainer.model))


def test_average_matches_a_hand_computation(digits):
    mx.random.seed(0)
    model = build_model("mlp", digits["info"], hidden_dims=[32])
    ema, record = EMA(decay=0.9), Record()
    Trainer(model, optim.Adam(1e-2), batch_size=64, max_steps=12, **_quiet()).train(
        digits["train"], epochs=1, callbacks=[ema, record])
    expected = dict(record.weights[0])
    for weights in record.weights[1:]:
        expected = {k: np.float32(0.9) * v + np.float32(1 - 0.9) * weights[k] for k, v in expected.items()}
    got = {k: np.array(v) for k, v in ema.weights().items()}
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-7, err_msg=name)
        assert not np.allclose(got[name], record.weights[-1][name], atol=1e-4)  # it is not the last weights


def _val_loss_by_hand(model, weights, x, y):
    model.load_weights(list(weights.items()), strict=False)
    model.eval()
    logits = model(mx.array(x))
    return float(nn.losses.cross_entropy(logits, mx.array(y)).mean().item())


@pytest.mark.parametrize("validate", [True, False])
def test_validation_uses_the_average(digits, validate):
    mx.random.seed(0)
    model = build_model("mlp", digits["info"], hidden_dims=[32])
    ema = EMA(decay=0.95, validate=validate)
    trainer = Trainer(model, optim.Adam(3e-3), batch_size=32, eval_batch_size=1000, **_quiet())
    history = trainer.train(digits["train"], digits["val"], epochs=2, callbacks=[ema])
    trained = {k: v for k, v in tree_flatten(model.parameters())}
    averaged = ema.weights()

    x, y = digits["val"]
    reference = build_model("mlp", digits["info"], hidden_dims=[32])
    by_hand_ema = _val_loss_by_hand(reference, averaged, x, y)
    by_hand_trained = _val_loss_by_hand(reference, trained, x, y)
    assert abs(by_hand_ema - by_hand_trained) > 1e-3  # the two differ, so the check below can fail
    expected = by_hand_ema if validate else by_hand_trained
    assert history["val_loss"][-1] == pytest.approx(expected, rel=1e-5)
    # Validation put the trained weights back.
    for name, value in trained.items():
        assert np.array_equal(np.array(value), np.array(dict(tree_flatten(model.parameters()))[name]))


def test_apply_to_and_checkpoint_weights_give_the_average(digits, tmp_path):
    mx.random.seed(0)
    model = build_model("cnn", digits["info"], channels=[4], hidden_dims=16)
    ema = EMA(decay=0.8)
    trainer = Trainer(model, optim.SGD(0.05, momentum=0.9), batch_size=64, max_steps=6, **_quiet())
    trainer.train(digits["train"], epochs=1, checkpoint_dir=str(tmp_path / "ckpt"), callbacks=[ema])
    averaged = {k: np.array(v) for k, v in ema.weights().items()}
    from_checkpoint = checkpoint_ema_weights(str(tmp_path / "ckpt" / "step-00000006"))
    assert sorted(from_checkpoint) == sorted(averaged) == sorted(_flat(model))
    for name, value in averaged.items():
        assert np.array_equal(np.array(from_checkpoint[name]), value)
    ema.apply_to(model)
    for name, value in _flat(model).items():
        assert np.array_equal(value, averaged[name])


def test_checkpoint_without_ema_is_a_clear_error(digits, tmp_path):
    model = build_model("mlp", digits["info"], hidden_dims=[8])
    Trainer(model, optim.SGD(0.1), batch_size=64, max_steps=2, **_quiet()).train(
        digits["train"], epochs=1, checkpoint_dir=str(tmp_path))
    with pytest.raises(Exception, match="holds no (callback arrays|EMA weights).*EMA"):
        checkpoint_ema_weights(str(tmp_path / "step-00000002"))


def test_average_of_a_pruned_model_is_as_sparse(digits):
    mx.random.seed(0)
    model = build_model("mlp", digits["info"], hidden_dims=[32])
    pruning = Pruning(0.7, start_step=0, end_step=10, frequency=2)
    ema = EMA(decay=0.9, pruning=pruning)
    Trainer(model, optim.Adam(1e-3), batch_size=64, max_steps=14, **_quiet()).train(
        digits["train"], epochs=1, callbacks=[pruning, ema])
    averaged = ema.weights()
    for name, mask in pruning.step_state["masks"].items():
        assert np.array_equal(np.array(averaged[name]) == 0, ~np.array(mask)), name


def test_in_process_resume_continues_the_average_bit_exact(digits, tmp_path):
    def run(resume=None, directory=tmp_path / "ckpt"):
        mx.random.seed(0)
        model = build_model("cnn", digits["info"], channels=[4], hidden_dims=16, dropout=0.2)
        ema = EMA(decay=0.9)
        trainer = Trainer(model, optim.AdamW(1e-3), batch_size=64, max_steps=16, checkpoint_every="4 steps",
                          keep_last=10, seed=2, **_quiet())
        trainer.train(digits["train"], digits["val"], epochs=1, checkpoint_dir=str(directory),
                      callbacks=[ema], resume=resume)
        return _flat(model), {k: np.array(v) for k, v in ema.weights().items()}, trainer.history

    full_params, full_ema, full_history = run()
    params, averaged, history = run(resume=str(tmp_path / "ckpt" / "step-00000008"), directory=tmp_path / "again")
    assert history == full_history
    for saved, full in ((params, full_params), (averaged, full_ema)):
        for name, value in full.items():
            assert np.array_equal(saved[name], value), name


def test_bad_decay_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"EMA decay must be in \[0, 1\), got 1.0"):
        EMA(decay=1.0)


def _newest(run_dir):
    return str(max((run_dir / "checkpoints").glob("step-*")))


def test_extensions_are_step_extensions_and_plain_callbacks_are_not():
    from mlx_train.training.extensions import StepExtension

    assert isinstance(EMA(0.9), StepExtension) and isinstance(Pruning(0.5, end_step=10), StepExtension)
    assert not isinstance(Record(), StepExtension)


@pytest.mark.slow
def test_set_ema_decay_trains_an_average_that_export_ema_writes(tmp_path, capsys):
    from mlx_train.checkpointing import load_checkpoint
    from mlx_train.cli.main import main

    run_dir = tmp_path / "run"
    assert main(["train", "--max-steps", "6", "--run-dir", str(run_dir), "--set", "ema_decay=0.8"]) == 0
    path = _newest(run_dir)
    averaged = {k: np.array(v) for k, v in checkpoint_ema_weights(path).items()}
    arrays, _ = load_checkpoint(path, groups=["model"])
    trained = {k.removeprefix("model."): np.array(v) for k, v in arrays["model"].items()}
    assert set(averaged) <= set(trained)
    assert all(not np.allclose(averaged[k], trained[k], atol=1e-5) for k in averaged)

    capsys.readouterr()
    for flags, name in ((["--ema"], "ema"), ([], "raw")):
        out = str(tmp_path / f"{name}.safetensors")
        assert main(["export", "--checkpoint", str(run_dir), "-o", out, *flags]) == 0
        exported = {k: np.array(v) for k, v in mx.load(out).items()}
        expected = averaged if name == "ema" else trained
        for key in averaged:
            assert np.array_equal(exported[key], expected[key]), (name, key)

    plain = tmp_path / "plain"
    assert main(["train", "--max-steps", "2", "--run-dir", str(plain)]) == 0
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(plain), "-o", str(tmp_path / "x.safetensors"), "--ema"]) != 0
    err = capsys.readouterr().err
    assert "no EMA weights" in err and "ema_decay" in err and "Traceback" not in err
    assert not (tmp_path / "x.safetensors").exists()

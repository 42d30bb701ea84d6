"""The Trainer: one-step smoke test, parity with a hand-written MLX loop, accumulation
equivalence, precisions, loss conventions, callbacks and clear errors."""

import json
import os

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train import ConfigError, DataError
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.training import Callback, DataLoader, EarlyStopping, ModelCheckpoint, Trainer


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


def _mlp(info, seed=0, **options):
    mx.random.seed(seed)
    return build_model("mlp", info, **options)


def _flat(model):
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def _max_rel_err(a, b):
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(a[k]).max() + 1e-12)) for k in a)


def _quiet(**kwargs):
    return {"report_every": "1000 steps", **kwargs}


def test_one_step_matches_a_hand_written_mlx_step(digits):
    x, y = digits["train"]
    model = _mlp(digits["info"])
    reference = _mlp(digits["info"])
    trainer = Trainer(model, optim.SGD(0.1), batch_size=32, shuffle=False, max_steps=1, **_quiet())
    trainer.train((x[:32], y[:32]), epochs=1)

    opt = optim.SGD(0.1)
    loss_and_grad = nn.value_and_grad(reference, lambda m, a, b: nn.losses.cross_entropy(m(a), b).mean())
    _, grads = loss_and_grad(reference, mx.array(x[:32]), mx.array(y[:32]))
    opt.update(reference, grads)
    got, want = _flat(model), _flat(reference)
    assert trainer.step == 1
    assert _max_rel_err(got, want) < 1e-6


def test_batches_gathered_by_mlx_train_exactly_as_numpy_ones(digits, monkeypatch):
    from mlx_train.data import sources

    def run():
        model = _mlp(digits["info"])
        trainer = Trainer(model, optim.AdamW(1e-3), batch_size=32, max_steps=50, **_quiet())
        history = trainer.train(digits["train"], digits["val"], epochs=2)
        return _flat(model), history

    resident, resident_history = run()  # the digits (~330 KB) are held by MLX
    monkeypatch.setattr(sources, "RESIDENT_MAX_BYTES", 0)
    host, host_history = run()
    assert all(np.array_equal(resident[k], host[k]) for k in host)
    assert resident_history["train_loss"] == host_history["train_loss"]


def test_accumulation_8x4_equals_32x1(digits):
    runs = {}
    for batch_size, accumulation in ((32, 1), (8, 4)):
        model = _mlp(digits["info"])
        trainer = Trainer(model, optim.Adam(1e-3), batch_size=batch_size, gradient_accumulation=accumulation,
                          seed=1, max_steps=20, **_quiet())
        trainer.train(digits["train"], epochs=1)
        assert trainer.step == 20
        runs[accumulation] = _flat(model)
    assert _max_rel_err(runs[1], runs[4]) < 1e-5
    untrained = _flat(_mlp(digits["info"]))
    assert _max_rel_err(runs[1], untrained) > 1e-3  # it really trained


def test_fit_with_dataloaders_returns_epoch_history(digits, tmp_path):
    train_loader = DataLoader(digits["train"], batch_size=32, shuffle=True, num_workers=2)
    val_loader = DataLoader(digits["val"], batch_size=64, shuffle=False)
    trainer = Trainer(_mlp(digits["info"]), optim.Adam(1e-3), run_dir=str(tmp_path), **_quiet())
    history = trainer.fit(train_loader, val_loader, epochs=3, save_best=True)
    assert len(history["train_loss"]) == len(history["val_loss"]) == len(history["val_accuracy"]) == 3
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert history["val_accuracy"][-1] > 0.85
    assert os.path.exists(tmp_path / "best_model.safetensors")


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_low_precision_trains_and_converges(digits, precision):
    model = _mlp(digits["info"])
    trainer = Trainer(model, optim.Adam(3e-3), batch_size=64, precision=precision, **_quiet())
    history = trainer.train(digits["train"], digits["val"], epochs=4)
    assert history["val_accuracy"][-1] > 0.9
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))  # float32 master weights


def test_float16_overflow_is_skipped_and_scale_halves(digits):
    model = _mlp(digits["info"])
    before = _flat(model)
    trainer = Trainer(model, optim.SGD(0.1), batch_size=32, precision="float16", loss_scale=1e30,
                      max_steps=1, **_quiet())
    trainer.train(digits["train"], epochs=1)
    assert _flat(model).keys() == before.keys()
    assert all(np.array_equal(_flat(model)[k], before[k]) for k in before)  # overflowed step skipped
    assert float(trainer.state.loss_scale["scale"].item()) == pytest.approx(5e29, rel=1e-3)


def test_loss_conventions_predictions_targets_and_model_batch(digits):
    results = []
    losses = [
        None,
        nn.losses.cross_entropy,  # (logits, targets) -> per-sample, averaged by the Trainer
        lambda model, batch: nn.losses.cross_entropy(model(batch[0]), batch[1]).mean(),
    ]
    for loss_fn in losses:
        model = _mlp(digits["info"])
        Trainer(model, optim.SGD(0.1), loss_fn=loss_fn, max_steps=5, **_quiet()).train(digits["train"], epochs=1)
        results.append(_flat(model))
    assert _max_rel_err(results[0], results[1]) < 1e-6
    assert _max_rel_err(results[0], results[2]) < 1e-6


def test_wrong_loss_convention_says_how_to_fix(digits):
    def model_style(predictions, batch):  # really wants (model, batch) but the first parameter is misnamed
        return nn.losses.cross_entropy(predictions(batch[0]), batch[1]).mean()

    trainer = Trainer(_mlp(digits["info"]), optim.SGD(0.1), loss_fn=model_style, max_steps=1, **_quiet())
    with pytest.raises(DataError, match="name its first parameter 'model'"):
        trainer.train(digits["train"], epochs=1)


def test_float_targets_with_default_loss_is_a_clear_error(digits):
    x, y = digits["train"]
    trainer = Trainer(_mlp(digits["info"]), optim.SGD(0.1), max_steps=1, **_quiet())
    with pytest.raises(DataError, match="integer class targets.*loss_fn=mlx.nn.losses.mse_loss"):
        trainer.train((x, y.astype(np.float32)), epochs=1)


def test_mismatched_dataset_lengths_is_a_clear_error(digits):
    x, y = digits["train"]
    trainer = Trainer(_mlp(digits["info"]), optim.SGD(0.1), **_quiet())
    with pytest.raises(DataError, match="length"):
        trainer.train((x, y[:-5]), epochs=1)


def test_wrong_input_width_is_a_clear_error(digits):
    x, y = digits["train"]
    trainer = Trainer(_mlp(digits["info"]), optim.SGD(0.1), max_steps=1, **_quiet())
    with pytest.raises(DataError, match=r"model failed on a batch of shapes \(\(32, 10\), \(32,\)\).*"
                                        r"match what the model expects"):
        trainer.train((x[:, :10], y), epochs=1)


def test_unknown_trainer_option_suggests_the_closest(digits):
    with pytest.raises(ConfigError, match="did you mean 'gradient_accumulation'"):
        Trainer(_mlp(digits["info"]), optim.SGD(0.1), gradient_acumulation=2)


def test_evaluate_and_predict(digits):
    model = _mlp(digits["info"])
    trainer = Trainer(model, optim.Adam(3e-3), **_quiet())
    trainer.train(digits["train"], epochs=3)
    metrics = trainer.evaluate(digits["test"])
    assert set(metrics) == {"loss", "accuracy"}
    outputs = trainer.predict(digits["test"])
    x_test, y_test = digits["test"]
    assert outputs.shape == (len(x_test), 10)
    accuracy = float((np.array(outputs.argmax(axis=-1)) == y_test).mean())
    assert accuracy == pytest.approx(metrics["accuracy"], abs=1e-9)
    assert accuracy > 0.9


def test_callbacks_events_early_stopping_and_model_checkpoint(digits, tmp_path):
    events = []

    class Recorder(Callback):
        def on_fit_start(self, trainer):
            events.append("fit_start")

        def on_epoch_end(self, trainer, epoch, logs):
            events.append(("epoch_end", epoch, sorted(logs)))

        def on_fit_end(self, trainer, history):
            events.append("fit_end")

    stopper = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)  # never "improves" after the first
    trainer = Trainer(_mlp(digits["info"]), optim.Adam(1e-3), **_quiet())
    with pytest.warns(UserWarning, match="safetensors, never pickle"):
        saver = ModelCheckpoint(str(tmp_path / "best.pt"), monitor="val_accuracy", save_best_only=True)
    history = trainer.train(digits["train"], digits["val"], epochs=10, callbacks=[Recorder(), stopper, saver])
    assert len(history["val_loss"]) == 2 and stopper.stopped_epoch == 1
    assert events[0] == "fit_start" and events[-1] == "fit_end"
    assert events[1][2] == ["learning_rate", "train_loss", "val_accuracy", "val_loss"]
    weights = mx.load(str(tmp_path / "best.safetensors"))
    assert set(weights) == set(_flat(trainer.model))


def test_mlx_lm_training_callback_is_accepted(digits):
    class MLXLMStyle:  # the shape of mlx_lm.tuner.callbacks.TrainingCallback
        def __init__(self):
            self.train, self.val = [], []

        def on_train_loss_report(self, info):
            self.train.append(info)

        def on_val_loss_report(self, info):
            self.val.append(info)

    cb = MLXLMStyle()
    Trainer(_mlp(digits["info"]), optim.Adam(1e-3), report_every="10 steps").train(
        digits["train"], digits["val"], epochs=1, callbacks=[cb])
    assert cb.train
    assert {"iteration", "train_loss", "learning_rate", "tokens_per_second", "peak_memory"} <= set(cb.train[0])
    assert cb.val and cb.val[0]["val_loss"] > 0


def test_metrics_logger_writes_jsonl_and_csv(digits, tmp_path):
    trainer = Trainer(_mlp(digits["info"]), optim.Adam(1e-3), run_dir=str(tmp_path), report_every="10 steps")
    trainer.train(digits["train"], digits["val"], epochs=2)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    kinds = {r["kind"] for r in rows}
    assert kinds == {"train", "val", "epoch"}
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert {"loss", "learning_rate", "samples_per_second", "peak_memory_gb"} <= set(train_rows[0])
    csv_lines = open(tmp_path / "metrics.csv").read().splitlines()
    assert len(csv_lines) == len(rows) + 1 and "loss" in csv_lines[0]


def test_progress_plain_lines_when_not_a_tty(digits, capsys):
    Trainer(_mlp(digits["info"]), optim.Adam(1e-3), report_every="10 steps").train(digits["train"], epochs=1)
    out = capsys.readouterr().out
    assert "step 10 | epoch 1 | loss" in out and "samples/s" in out and "peak mem" in out
    assert "epoch 1/1: train_loss" in out


def test_language_model_reports_tokens_per_second():
    data = load_dataset("text", seed=0, block_size=32)
    mx.random.seed(0)
    model = build_model("transformer", data["info"], dims=32, num_layers=1, num_heads=2)
    seen = []

    class Grab(Callback):
        def on_report(self, trainer, logs):
            seen.append(logs)

    trainer = Trainer(model, optim.Adam(3e-3), batch_size=16, max_steps=20, report_every="10 steps")
    trainer.train(data["train"], epochs=1, callbacks=[Grab()])
    assert seen and "tokens_per_second" in seen[0]
    assert seen[-1]["loss"] < seen[0]["loss"]


def test_checkpoints_to_an_fsspec_url_and_resume_from_it(digits):
    url = "memory://mlx-train-test/ckpts"
    first = Trainer(_mlp(digits["info"]), optim.Adam(1e-3), max_steps=12, checkpoint_every="5 steps", **_quiet())
    first.train(digits["train"], epochs=1, checkpoint_dir=url)
    second = Trainer(_mlp(digits["info"], seed=1), optim.Adam(1e-3), max_steps=12, **_quiet())
    second.train(digits["train"], epochs=1, checkpoint_dir=url, resume="auto")
    assert second.step == 12
    first_params, second_params = _flat(first.model), _flat(second.model)
    assert first_params.keys() == second_params.keys()
    assert all(np.array_equal(first_params[k], second_params[k]) for k in first_params)


def test_resume_auto_skips_a_corrupt_newest_checkpoint(digits, tmp_path, capsys):
    trainer = Trainer(_mlp(digits["info"]), optim.Adam(1e-3), max_steps=10, checkpoint_every="5 steps",
                      keep_last=5, **_quiet())
    trainer.train(digits["train"], epochs=1, checkpoint_dir=str(tmp_path))
    newest = tmp_path / "step-00000010" / "optimizer.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # torn write
    resumed = Trainer(_mlp(digits["info"]), optim.Adam(1e-3), max_steps=10, **_quiet())
    with pytest.warns(UserWarning, match="step-00000010"):
        resumed.train(digits["train"], epochs=1, checkpoint_dir=str(tmp_path), resume="auto")
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'step-00000005'} (step 5" in out
    assert resumed.step == 10


def test_a_run_counted_in_steps_reports_its_open_epoch_and_step_validations(capsys):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((256, 4)).astype(np.float32), rng.integers(0, 2, 256).astype(np.int32)
    seen = []

    class Count(Callback):
        def on_validation_end(self, trainer, logs):
            seen.append(logs)

    trainer = Trainer(nn.Linear(4, 2), optim.SGD(0.1), batch_size=8, num_workers=0, max_steps=10,
                      eval_every="4 steps", val_batches=2, report_every="5 steps")
    history = trainer.train((x, y), (x[:64], y[:64]), epochs=1, callbacks=[Count()])
    assert len(history["train_loss"]) == 1 and np.isfinite(history["train_loss"][0])  # stopped mid-epoch
    assert history["val_loss"] == [seen[-1]["val_loss"]]
    out = capsys.readouterr().out
    assert "step 4 | validation: val_loss" in out and "step 8 | validation: val_loss" in out


def test_val_batches_validates_on_the_first_batches_each_time():
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((64, 4)).astype(np.float32), rng.integers(0, 2, 64).astype(np.int32)
    seen = []

    class Count(Callback):
        def on_validation_end(self, trainer, logs):
            seen.append(logs["val_loss"])

    model = nn.Linear(4, 2)
    trainer = Trainer(model, optim.SGD(0.0), batch_size=8, num_workers=0, max_steps=3, eval_every="1 steps",
                      val_batches=2)  # learning rate 0: every validation sees the same weights
    trainer.train((x, y), (x, y), epochs=1, callbacks=[Count()])
    first_two_batches = trainer.evaluate((x[:16], y[:16]))["loss"]
    assert len(seen) == 3 and all(v == pytest.approx(first_two_batches, rel=1e-6) for v in seen)
    assert trainer.evaluate((x, y))["loss"] != pytest.approx(first_two_batches, rel=1e-6)


def test_with_frozen_parameters_checkpoints_and_best_weights_hold_only_what_trains(tmp_path):
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((64, 4)).astype(np.float32), rng.integers(0, 2, 64).astype(np.int32)
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    model.layers[0].freeze()
    trainable = set(dict(tree_flatten(model.trainable_parameters())))
    stopper = EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True)
    best = tmp_path / "best.safetensors"
    trainer = Trainer(model, optim.Adam(1e-2), batch_size=8, num_workers=0)
    trainer.train((x, y), (x, y), epochs=2, checkpoint_dir=str(tmp_path / "ck"),
                  callbacks=[stopper, ModelCheckpoint(str(best), save_best_only=True)])
    assert set(mx.load(str(best))) == trainable == set(stopper.best_weights) == {"layers.2.weight", "layers.2.bias"}
    latest = sorted(p for p in os.listdir(tmp_path / "ck") if p.startswith("step-"))[-1]
    assert set(mx.load(str(tmp_path / "ck" / latest / "model.safetensors"))) == trainable


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_fit_and_train_read_a_dataloader_batch_the_same_way(digits, accumulation, architecture):
    """A DataLoader's batch is a micro-batch for train() as for fit(): the same steps, the same weights,
    and a step of batch_size x accumulation samples (as train() on arrays)."""
    x, y = digits["train"]
    runs = {}
    for how in ("fit", "train", "arrays"):
        mx.random.seed(0)
        model = build_model(architecture, digits["info"])
        trainer = Trainer(model, optim.Adam(1e-3), batch_size=8, gradient_accumulation=accumulation, seed=2,
                          max_steps=12, shuffle=False, **_quiet())
        loader = DataLoader((x, y), batch_size=8, shuffle=False, seed=2)
        if how == "fit":
            trainer.fit(loader, epochs=1, save_best=False)
        elif how == "train":
            trainer.train(loader, epochs=1)
        else:
            trainer.train((x, y), epochs=1)
        assert trainer.step == 12
        assert trainer.state.trained_samples == 12 * 8 * accumulation
        runs[how] = _flat(model)
    assert _max_rel_err(runs["fit"], runs["train"]) == 0.0
    assert _max_rel_err(runs["train"], runs["arrays"]) < 1e-6


def test_a_loss_prepare_builds_each_batch_in_the_main_thread_before_its_step():
    """A loss with ``prepare(model, batch, step)`` (reinforcement learning's rollouts) gets every training
    batch in the main thread with the steps taken so far, and every evaluation batch with None; the step
    and the accumulation cut the batch it returns (here: each row doubled, so twice the items)."""
    import threading

    seen = []

    class Doubling:
        def prepare(self, model, batch, step):
            seen.append((step, threading.current_thread() is threading.main_thread(), batch["x"].shape[0]))
            return {k: mx.concatenate([v, v]) for k, v in batch.items()}

        def __call__(self, model, batch):
            return nn.losses.mse_loss(model(batch["x"]), batch["y"]), batch["x"].shape[0]

    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(16, 3)).astype(np.float32), "y": rng.normal(size=(16, 1)).astype(np.float32)}
    mx.random.seed(0)
    trainer = Trainer(nn.Linear(3, 1), optim.SGD(0.1), loss_fn=Doubling(), batch_size=4, gradient_accumulation=2,
                      num_workers=2, **_quiet())
    trainer.train(DataLoader(data, batch_size=4, shuffle=False, num_workers=2), epochs=1)
    assert seen == [(0, True, 8), (1, True, 8)]
    assert trainer.state.trained_items == 32  # the prepared rows, two micro-batches of 8 per step
    seen.clear()
    trainer.evaluate(DataLoader(data, batch_size=8, shuffle=False))
    assert seen == [(None, True, 8), (None, True, 8)]

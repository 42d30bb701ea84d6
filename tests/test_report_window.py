"""The per-step loss in reports is summed over the report window itself: late in a long epoch it is as
exact as the window's own losses, where a difference of two large float32 epoch sums is not."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlx_train.training import Callback, Trainer
from mlx_train.training.callbacks import CallbackList
from mlx_train.training.state import LoopState

STEPS = 2000


def _echo_loss(model, x, y):
    """Each sample's own value as its loss (the model's output times zero keeps it in the graph)."""
    value = x.mean() + 0.0 * model(x).mean()
    return value, mx.array(1.0), {"echo": x.mean()}


_echo_loss.metric_names = ("echo",)


def _trained_echo_loss(model, x, y):
    """The echo loss plus a small term that trains the model."""
    value, n, metrics = _echo_loss(model, x, y)
    return value + (model(x - 1000.0) ** 2).mean(), n, metrics


_trained_echo_loss.metric_names = ("echo",)


class Reports(Callback):
    def __init__(self):
        self.logs = []

    def on_report(self, trainer, logs):
        self.logs.append(logs)


def test_per_step_reports_late_in_a_long_epoch_are_the_window_losses_exactly():
    rng = np.random.default_rng(0)
    x = (1000.0 + rng.random((STEPS, 1))).astype(np.float32)  # a large loss with a small varying part
    y = np.zeros((STEPS,), dtype=np.float32)
    reports = Reports()
    trainer = Trainer(nn.Linear(1, 1), optim.SGD(0.0), loss_fn=_echo_loss, batch_size=1, shuffle=False,
                      report_every="1 steps")
    history = trainer.train((x, y), epochs=1, callbacks=[reports])

    want = x[:, 0].astype(np.float64)
    assert [logs["step"] for logs in reports.logs] == list(range(1, STEPS + 1))
    for key in ("loss", "echo"):
        got = np.array([logs[key] for logs in reports.logs])
        assert np.abs(got / want - 1).max() < 1e-7, key
    epoch_sum = np.float32(0.0)
    for value in x[:, 0]:  # the epoch's train_loss still comes from the epoch's float32 sum
        epoch_sum = np.float32(epoch_sum + value)
    assert history["train_loss"] == [float(epoch_sum) / STEPS]


def test_a_resume_in_the_middle_of_a_report_window_reports_what_the_uninterrupted_run_does(tmp_path):
    rng = np.random.default_rng(1)
    data = ((1000.0 + rng.random((64, 1))).astype(np.float32), np.zeros((64,), dtype=np.float32))

    def run(max_steps, resume=None):
        mx.random.seed(0)
        reports = Reports()
        trainer = Trainer(nn.Linear(1, 1), optim.SGD(0.1), loss_fn=_trained_echo_loss, batch_size=2,
                          max_steps=max_steps, report_every="4 steps", checkpoint_every="6 steps")
        trainer.train(data, epochs=1, callbacks=[reports], checkpoint_dir=str(tmp_path / (resume or "whole")),
                      resume="auto" if resume else None)
        return {logs["step"]: (logs["loss"], logs["echo"]) for logs in reports.logs}

    whole = run(12)
    run(6, resume="cut")  # saved at step 6: half-way through the window of steps 5 to 8
    resumed = run(12, resume="cut")
    assert list(resumed) == [8, 12] and all(resumed[step] == whole[step] for step in resumed)


def test_a_checkpoint_saved_before_window_sums_resumes_with_the_window_so_far():
    model, optimizer = nn.Linear(1, 1), optim.SGD(0.1)
    optimizer.init(model.trainable_parameters())
    sums = {"loss_sum": 10.0, "items": 5.0, "metric:echo": 4.0}
    state = LoopState(step=5, report_base={"loss_sum": 6.0, "items": 3.0, "metric:echo": 1.0, "step": 3})
    arrays, saved = state.capture(model, optimizer, None, CallbackList([]), _NoConfig(), sums)
    saved["format_version"] = 3  # written before the report window had its own sums
    restored = LoopState()
    restored.restore("ckpt", arrays, saved, model, optimizer, None, CallbackList([]))
    window = {k: float(v.item()) for k, v in restored.running.items() if k.startswith("window:")}
    assert window == {"window:loss_sum": 4.0, "window:items": 2.0, "window:metric:echo": 3.0}


class _NoConfig:
    def to_dict(self):
        return {}

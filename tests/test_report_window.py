"""The per-step loss in reports is summed over the report window itself: late in a long epoch it is as
exact as the window's own losses, where a difference of two large float32 epoch sums is not."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlx_train.training import Callback, Trainer

STEPS = 2000


def _echo_loss(model, x, y):
    """Each sample's own value as its loss (the model's output times zero keeps it in the graph)."""
    value = x.mean() + 0.0 * model(x).mean()
    return value, mx.array(1.0), {"echo": x.mean()}


_echo_loss.metric_names = ("echo",)


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

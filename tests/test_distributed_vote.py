"""The ranks' stop vote travels in the gradient all-reduce of the compiled step (no collective of its
own), here on a group of one; tests/test_distributed_interrupt.py stops two real ranks with it."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlx_train.distributed.reduction import fused_average
from mlx_train.training.losses import Loss
from mlx_train.training.state import LoopState
from mlx_train.training.step import StepOptions, build_step


def test_the_stop_vote_is_summed_with_the_gradients_in_one_all_reduce(monkeypatch):
    calls = []
    all_sum = mx.distributed.all_sum
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, **kw: calls.append(x.shape) or all_sum(x, **kw))
    mx.random.seed(0)
    model, state = nn.Linear(4, 3), LoopState()
    reduction = fused_average(mx.distributed.init())
    step = build_step(model, optim.SGD(0.1), Loss(), StepOptions(), state.loss_scale, reduction)
    state.running = step.zero_running()
    batch = (mx.array(np.ones((8, 4), np.float32)), mx.array(np.zeros(8, np.int32)))
    seen = []
    for vote in (0.0, 1.0, 0.0, 1.0, 0.0, 0.0):  # set before each step, as the Trainer does
        reduction.state["stop"] = mx.array(vote)
        state.running = step(state, batch)
        seen.append(reduction.state["stop"].item())
    assert seen == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert calls and set(calls) == {(4 * 3 + 3 + 2,)}  # per trace: gradients, item count and vote in one all_sum


def test_a_new_run_does_not_inherit_the_vote_that_stopped_the_last_one():
    from mlx_train.training import Trainer

    trainer = Trainer(nn.Linear(4, 3), optim.SGD(0.1), batch_size=8, num_workers=0, max_steps=2)
    trainer.gradient_reduction = fused_average(mx.distributed.init())
    trainer.gradient_reduction.state["stop"] = mx.array(2.0)  # the sum after a run that two ranks stopped
    trainer.train((np.ones((32, 4), np.float32), np.zeros(32, np.int32)), epochs=1)
    assert trainer.step == 2 and trainer.gradient_reduction.state["stop"].item() == 0.0


def test_a_signal_to_a_rank_that_the_vote_already_stops_is_its_first_not_a_second():
    """A rank whose peer asked to stop stops by the vote; a signal of its own that comes just after (a
    supervisor's, or the rank's own watch of a dead supervisor) must not cut it short before the stop
    checkpoint's barrier, where its peers wait for it: only a second signal to the same process does."""
    import os
    import signal

    import pytest

    from mlx_train.errors import TrainingInterrupted
    from mlx_train.training.interrupt import StopSignals

    with StopSignals(lambda line: None, lambda: 7, vote=lambda requested: True) as signals:
        signals.vote()  # another rank asked: this one stops after this step too
        assert signals.requested == signal.SIGTERM and signals.received is None and signals.stopping
        os.kill(os.getpid(), signal.SIGTERM)  # its own, late
        assert signals.received == signal.SIGTERM and signals.stopping
        with pytest.raises(TrainingInterrupted, match="SIGTERM again: stopped at once at step 7"):
            os.kill(os.getpid(), signal.SIGTERM)

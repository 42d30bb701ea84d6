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

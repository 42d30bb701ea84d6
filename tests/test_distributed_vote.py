"""The ranks' votes travel in the gradient all-reduce of the compiled step (no collective of their own),
here on a group of one and on two real ranks; tests/test_distributed_interrupt.py stops two real ranks with
the stop vote, tests/test_oom.py makes them recover together from running out of memory."""

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

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


def test_the_votes_travel_as_the_digits_of_one_number_that_a_sum_over_ranks_keeps_apart():
    from mlx_train.distributed.reduction import Votes

    names = ("stop", "out_of_memory", "check_after")
    ranks = [Votes(3, names) for _ in range(3)]
    ranks[0].cast(stop=True, check_after=True)
    ranks[1].cast(check_after=True)
    ranks[2].cast(stop=True, out_of_memory=True, check_after=True)
    total = sum(votes.state["stop"] for votes in ranks)  # what the all-reduce computes
    for votes in ranks:
        votes.state["stop"] = total
        assert votes.summed() == {"stop": 2, "out_of_memory": 1, "check_after": 3}
        assert votes.summed() is votes.summed() and votes.reads == 1  # read once per step
    assert ranks[0].fits(mx.float32) and ranks[0].fits(mx.bfloat16)  # 4**3 - 1 = 63: exact in bfloat16
    assert not Votes(8, names).fits(mx.bfloat16) and Votes(8, names).fits(mx.float32)  # 9**3 - 1 = 728


def test_every_collective_the_library_makes_goes_through_the_seam_that_lists_them():
    import ast
    import pathlib

    import mlx_train

    root = pathlib.Path(mlx_train.__file__).parent
    exempt = {"distributed/collectives.py", "distributed/probe.py"}  # the seam; check-network's own probe
    direct = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in exempt:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "mx.distributed" and \
                    node.attr.startswith(("all_", "sum_scatter", "send", "recv")):
                direct.append(f"{path.relative_to(root)}:{node.lineno} mx.distributed.{node.attr}")
    assert direct == []  # use mlx_train.distributed.collectives: recording_collectives then lists them


@pytest.mark.slow
@pytest.mark.distributed
def test_a_data_parallel_step_makes_one_all_reduce_and_one_host_read(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "scripts", "dp_count_run.py")
    launcher = shutil.which("mlx.launch") or os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    out = tmp_path / "counts.json"
    subprocess.run([launcher, "-n", "2", "--", sys.executable, script, str(out), "--accumulation", "2",
                    "--steps", "8"], check=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}, timeout=300,
                   stdout=subprocess.DEVNULL)
    counts = json.load(open(out))
    steps = counts["steps"]
    assert [s["step"] for s in steps] == list(range(1, 9))
    # Every step: one all-reduce in the compiled step (of its 2 micro-batches, the update's), carrying the
    # gradients, the item count and the vote word; one host read of the summed votes.
    assert all(s["inside"] == [["all_sum", counts["parameters"] + 2]] for s in steps)
    assert all(s["reads"] == 1 for s in steps)
    # Outside the compiled step: nothing once the steps are past their shape's first two, which the memory
    # guard checks after the update (step 2: that check alone; step 1 also traces the step and plans).
    assert [s["outside"] for s in steps[1:]] == [1] + [0] * 6

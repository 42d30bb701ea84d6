"""Communication time of tensor-parallel steps: the collectives inside the forward and backward passes are
counted from the step's own code through the collectives seam (exact bytes and calls, checked against the
model's shapes) and timed on the group; 2 ranks launched for real on 127.0.0.1. Data-parallel and
one-process reports are unchanged."""

import json
import os
import re
import subprocess
import sys

import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

# isort: split
import mlx.core as mx
import pytest

from mlx_train.distributed import collectives
from mlx_train.distributed.comm import Collective, StepCommunication, recording_collectives, time_collectives
from mlx_train.monitor.dashboard import format_seconds

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
sys.path.insert(0, os.path.dirname(__file__))
from test_tensor_parallel import ENV, _launcher  # noqa: E402

# The tiny llama of tests/scripts/llm_tiny.py and the run of tp_comm_run.py.
LAYERS, HIDDEN, LORA_RANK, BATCH, VOCAB = 2, 32, 4, 8, 96
FLOAT32, VOTE, CLIP_NORM, GUARD_VOTE = 4, 4, 4, 8  # bytes: an activation element, the scalars, 2 int32


# -- one process --------------------------------------------------------------------------------


def test_recording_lists_each_collective_made_through_the_seam_and_rebinds_nothing():
    names = ("all_sum", "all_max", "all_min", "all_gather", "sum_scatter")
    originals = [getattr(mx.distributed, name) for name in names]
    x = mx.ones((3, 5), dtype=mx.float16)
    with recording_collectives() as seen:
        assert [getattr(mx.distributed, name) for name in names] == originals  # MLX is left as it is
        collectives.all_sum(x)
        collectives.all_gather(mx.ones((2,), dtype=mx.int32))
        mx.distributed.all_sum(x)  # made directly, not through the seam: not listed
    assert seen == [Collective("all_sum", (3, 5), mx.float16), Collective("all_gather", (2,), mx.int32)]
    assert [c.nbytes for c in seen] == [30, 8]
    with pytest.raises(ValueError, match="inside"), recording_collectives() as failed:
        raise ValueError("inside")
    collectives.all_max(x)  # after the block: listed nowhere
    assert failed == [] and len(seen) == 2


def test_mlx_sharded_linears_are_tracked_with_the_same_arrays_results_and_gradients():
    import mlx.nn as nn
    from mlx.nn.layers.distributed import shard_linear
    from mlx.utils import tree_flatten

    from mlx_train.distributed.tensor import track_collectives, untracked_modules
    from mlx_train.distributed.tensor.linears import TrackedAllToShardedLinear, TrackedShardedToAllLinear

    group = mx.distributed.init()
    mx.random.seed(0)
    model = nn.Sequential(shard_linear(nn.Linear(8, 16), "all-to-sharded", group=group), nn.ReLU(),
                          shard_linear(nn.Linear(16, 4, bias=False), "sharded-to-all", group=group))
    model.layers[0].freeze(keys=["bias"])
    x = mx.random.normal((3, 8))

    def loss(params, model):
        model.update(params)
        return mx.sum(model(x) ** 2)

    before = mx.value_and_grad(loss)(model.trainable_parameters(), model)
    weights = [model.layers[0].weight, model.layers[2].weight]
    assert sorted(untracked_modules(model)) == ["layers.0", "layers.2"]
    assert track_collectives(model) == 2 and untracked_modules(model) == []
    assert type(model.layers[0]) is TrackedAllToShardedLinear and type(model.layers[2]) is TrackedShardedToAllLinear
    assert model.layers[0].weight is weights[0] and model.layers[2].weight is weights[1]  # nothing copied
    assert [k for k, _ in tree_flatten(model.trainable_parameters())] == ["layers.0.weight", "layers.2.weight"]
    with recording_collectives() as seen:
        after = mx.value_and_grad(loss)(model.trainable_parameters(), model)
    assert seen == [Collective("all_sum", (3, 4), mx.float32)]  # the sharded-to-all output (a group of one)
    assert mx.array_equal(before[0], after[0]).item()
    for (_, a), (_, b) in zip(tree_flatten(before[1]), tree_flatten(after[1]), strict=True):
        assert mx.array_equal(a, b).item()


def test_a_lone_process_spends_no_time_communicating():
    group = mx.distributed.init()
    assert time_collectives([Collective("all_sum", (4, 4), mx.float32)], group) == 0.0
    counting = StepCommunication(group, per_step=[Collective("all_sum", (2,), mx.int32)])
    counting.tally[((8, 16),), True, False] = 3
    counting.calls[((8, 16),), True, False] = [Collective("all_sum", (8, 16, 32), mx.float32)] * 2
    window = counting.window(steps=3)
    assert (window.seconds, window.collectives, window.nbytes) == (0.0, 3.0, 2 * 8 * 16 * 32 * 4 + 8)
    assert counting.tally == {} and counting.window(steps=0).collectives == 0.0


def _train_steps(counted):
    """Four steps (2 micro-batches each) of a model with dropout, with or without its collectives counted."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    from mlx_train.training.losses import Loss
    from mlx_train.training.state import LoopState
    from mlx_train.training.step import StepOptions, build_step

    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 3))
    optimizer = optim.Adam(1e-2)
    optimizer.init(model.trainable_parameters())
    state = LoopState()
    step = build_step(model, optimizer, Loss(), StepOptions(accumulation=2), state.loss_scale)
    counting = StepCommunication(mx.distributed.init())
    if counted:
        counting.install(step)
    state.begin_epoch(0, step.zero_running())
    rng = np.random.default_rng(0)
    for length in (12, 12, 10, 12):  # two micro-batch shapes: 6 and 5 rows
        batch = (mx.array(rng.normal(size=(length, 8)).astype(np.float32)), mx.array(rng.integers(0, 3, length)))
        state.advance(step(state, batch), length)
    return float(state.running["loss_sum"].item()), model.parameters(), counting


def test_counting_a_steps_collectives_leaves_its_training_unchanged():
    loss, params, _ = _train_steps(counted=False)
    counted_loss, counted_params, counting = _train_steps(counted=True)
    assert counted_loss == loss  # the same dropout masks: the random key was put back after each trace
    assert mx.array_equal(counted_params["layers"][0]["weight"], params["layers"][0]["weight"]).item()
    assert mx.array_equal(counted_params["layers"][3]["weight"], params["layers"][3]["weight"]).item()
    # one trace per (micro-batch shape, update, weighted); every micro-batch counted
    assert sorted(counting.calls) == [(((5, 8), (5,)), False, True), (((5, 8), (5,)), True, True),
                                      (((6, 8), (6,)), False, True), (((6, 8), (6,)), True, True)]
    assert sum(counting.tally.values()) == 8 and counting.tally[(((6, 8), (6,)), True, True)] == 3


def test_quantized_sharded_linears_are_tracked_frozen_with_the_same_results():
    import mlx.nn as nn
    from mlx.nn.layers.distributed import shard_linear
    from mlx.utils import tree_flatten

    from mlx_train.distributed.tensor import track_collectives
    from mlx_train.distributed.tensor.linears import (
        TrackedQuantizedAllToShardedLinear,
        TrackedQuantizedShardedToAllLinear,
    )

    group = mx.distributed.init()
    mx.random.seed(0)
    up, down = nn.QuantizedLinear(64, 64, bias=True), nn.QuantizedLinear(64, 64, bias=False)
    model = nn.Sequential(shard_linear(up, "all-to-sharded", group=group), nn.ReLU(),
                          shard_linear(down, "sharded-to-all", group=group))
    x = mx.random.normal((2, 64))
    before = model(x)
    arrays = dict(tree_flatten(model.parameters()))
    assert track_collectives(model) == 2
    assert [type(m) for m in (model.layers[0], model.layers[2])] == [TrackedQuantizedAllToShardedLinear,
                                                                      TrackedQuantizedShardedToAllLinear]
    assert all(v is arrays[k] for k, v in tree_flatten(model.parameters()))
    assert tree_flatten(model.trainable_parameters()) == []  # MLX's quantized layers are frozen: still so
    with recording_collectives() as seen:
        after = model(x)
    assert seen == [Collective("all_sum", (2, 64), mx.float32)]
    assert mx.array_equal(before, after).item()


# -- two processes -------------------------------------------------------------------------------


def _run(out, *extra, ranks=2):
    command = [sys.executable, os.path.join(SCRIPTS, "tp_comm_run.py"), str(out), *extra]
    if ranks > 1:
        command = [_launcher(), "-n", str(ranks), "--", *command]
    subprocess.run(command, check=True, env=ENV, timeout=300, stdout=subprocess.DEVNULL)
    with open(out / "rows.json") as f:
        return json.load(f)


def _activation(length, width=HIDDEN):
    """Bytes of one (batch, length, width) float32 activation: what a sharded layer all-reduces."""
    return BATCH * length * width * FLOAT32


#: The tied embedding split by vocabulary: the lookup all-reduces its rows (forward), the head gathers each
#: rank's half of the logits (forward) and all-reduces its input's gradient (backward).
VOCAB_COLLECTIVES = 3


def _vocabulary(length):
    return 2 * _activation(length) + _activation(length, VOCAB // 2)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return out, _run(out, "--length", "16")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tensor_parallel_step_reports_its_communication_time(full_run):
    _, rows = full_run
    assert len(rows) == 4
    for row in rows:
        assert 0 < row["time_comm"] <= row["step_time"]
        assert row["time_compute"] + row["time_comm"] + row["time_data"] <= row["step_time"] * 1.0001
        # per layer: the attention output and MLP down projections all-reduce their outputs (2), and q, k, v,
        # gate and up their input's gradient (5); the split vocabulary's three; then the step's stop vote and
        # the memory guard's vote
        assert row["comm_collectives"] == 7 * LAYERS + VOCAB_COLLECTIVES + 2
        assert row["comm_bytes"] == 7 * LAYERS * _activation(16) + _vocabulary(16) + VOTE + GUARD_VOTE


@pytest.mark.slow
@pytest.mark.distributed
def test_the_bytes_follow_the_tokens_the_micro_batches_and_the_gradients_needed(full_run, tmp_path):
    _, rows = full_run
    longer = _run(tmp_path / "longer", "--length", "32", "--accumulation", "2", "--max-grad-norm", "1.0")
    # twice the tokens: twice the activation bytes; two micro-batches: each layer's collectives twice; clipping:
    # the norm of the split gradient summed over the ranks
    assert longer[-1]["comm_collectives"] == 2 * (7 * LAYERS + VOCAB_COLLECTIVES) + 3
    assert longer[-1]["comm_bytes"] == 7 * LAYERS * _activation(32) + _vocabulary(32) + VOTE + CLIP_NORM + GUARD_VOTE
    assert longer[-1]["comm_bytes"] - VOTE - CLIP_NORM - GUARD_VOTE == 2 * (rows[-1]["comm_bytes"] - VOTE - GUARD_VOTE)
    lora = _run(tmp_path / "lora", "--mode", "lora", "--length", "16")
    # LoRA: the base is frozen, so layer 0's attention input needs no gradient (its q, k, v all-reduce none),
    # while each adapter all-reduces its rank-4 activation (forward for o/down, gradient for q/k/v/gate/up)
    hidden = 2 * LAYERS + 2 + 5 * (LAYERS - 1)
    low_rank = 2 * LAYERS + 5 * LAYERS
    assert lora[-1]["comm_collectives"] == hidden + low_rank + VOCAB_COLLECTIVES + 2
    assert lora[-1]["comm_bytes"] == hidden * _activation(16) + low_rank * _activation(16, LORA_RANK) + \
        _vocabulary(16) + VOTE + GUARD_VOTE
    assert 0 < lora[-1]["time_comm"] <= lora[-1]["step_time"]


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_and_one_process_reports_are_unchanged(tmp_path):
    dp = _run(tmp_path / "dp", "--data-parallel")
    estimate = max(row["time_comm"] for row in dp)  # timed once at start-up, capped at each step's own time
    assert all(0 < row["time_comm"] <= row["step_time"] for row in dp)
    assert all(row["time_comm"] == estimate or row["time_compute"] == 0.0 for row in dp)
    one = _run(tmp_path / "one", ranks=1)
    for row in dp + one:
        assert "comm_bytes" not in row and "comm_collectives" not in row
    assert all(row["time_comm"] == 0.0 for row in one)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_monitor_breakdown_shows_the_communication_of_a_tensor_parallel_run(full_run, capsys):
    from mlx_train.cli.main import main

    out, rows = full_run
    capsys.readouterr()
    assert main(["monitor", str(out / "run"), "--once", "--performance"]) == 0
    text = capsys.readouterr().out
    lines = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in lines if r.get("kind") == "train"][-4:]
    comm_mean = sum(r["time_comm"] for r in last) / len(last)
    share = comm_mean / (sum(r["step_time"] for r in last) / len(last))
    assert comm_mean > 0
    assert re.search(rf"communication\s+{re.escape(format_seconds(comm_mean))}\s+{share:.1%}", text), text
    assert f"communication: {7 * LAYERS + VOCAB_COLLECTIVES + 2} collectives a step, " \
           f"{(7 * LAYERS * _activation(16) + _vocabulary(16) + VOTE + GUARD_VOTE) / 1e3:.1f} KB from each rank" in text

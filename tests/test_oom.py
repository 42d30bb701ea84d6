"""Out-of-memory: MLX's allocation failures become OutOfMemoryError, and the Trainer recovers from them
(half the micro-batch, twice the accumulation, same result), also against a real memory budget."""

import gc
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
from mlx.utils import tree_flatten

from mlx_train import DeviceConfig, OutOfMemoryError
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.testing import SimulatedOutOfMemory
from mlx_train.training import Trainer
from mlx_train.training.oom import (
    CPU_MESSAGE,
    CUDA_MESSAGE,
    METAL_MESSAGE,
    any_rank,
    is_out_of_memory,
    out_of_memory,
)
from mlx_train.training.state import rng_key

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "oom_run.py")


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


def _flat(model):
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def _max_rel_err(a, b):
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(a[k]).max() + 1e-12)) for k in a)


def _train(digits, batch_size, accumulation, callbacks=(), steps=8, dropout=0.0, **options):
    mx.random.seed(0)
    model = build_model("mlp", digits["info"], dropout=dropout)
    trainer = Trainer(model, optim.Adam(1e-3), batch_size=batch_size, gradient_accumulation=accumulation,
                      max_steps=steps, seed=1, report_every="1000 steps", num_workers=0, **options)
    trainer.train(digits["train"], epochs=1, callbacks=list(callbacks))
    return trainer, _flat(model)


@pytest.mark.parametrize("message", [
    CPU_MESSAGE, METAL_MESSAGE, CUDA_MESSAGE,
    "[malloc_or_wait] Unable to allocate 4096 bytes.",
    "[metal::malloc] Resource limit (499000) exceeded.",
    "[METAL] Command buffer execution failed: Insufficient Memory "
    "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
    "cuMemAlloc(&ptr, size) failed: out of memory",
])
def test_mlx_allocation_failures_are_recognised(message):
    assert is_out_of_memory(RuntimeError(message))


def test_other_errors_are_not_out_of_memory():
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("[matmul] Last dimension of first input with shape (2,3) must match"))
    assert not is_out_of_memory(ValueError("out of memory"))  # MLX raises RuntimeError for allocations
    with pytest.raises(OutOfMemoryError, match=r"out of memory during evaluation: \[malloc\] Unable to allocate "
                                               r".* To fix: lower eval_batch_size"):
        with out_of_memory("evaluation", "lower eval_batch_size"):
            raise RuntimeError(CPU_MESSAGE)
    with pytest.raises(KeyError):
        with out_of_memory("evaluation", "lower eval_batch_size"):
            raise KeyError("not memory")
    assert any_rank(True) and not any_rank(False, None)


@pytest.mark.parametrize("where, step, options", [
    ("update", 2, {}),                                # a step of a new shape: ready to be undone
    ("first micro-batch", 2, {}),
    ("update", 6, {"memory_limit": "64GB"}),          # with a budget: every step is ready
    ("update", 6, {"device_config": DeviceConfig(memory_limit="64GB")}),
])
def test_a_failed_step_is_retried_with_half_the_micro_batch_and_gives_the_same_result(digits, where, step,
                                                                                       options):
    # The failure comes after the step's compiled update (or its first micro-batch) was dispatched:
    # recovery must undo it, then redo the same step batch as 16 x 2.
    simulated = SimulatedOutOfMemory(steps=[step], micro_batch=-1 if where == "update" else 0)
    accumulation = 1 if where == "update" else 2
    trainer, recovered = _train(digits, 32 // accumulation, accumulation, [simulated], **options)
    assert simulated.failures == [step] and trainer.step == 8
    guard = trainer.memory_guard
    assert guard.batch_size == 16 // accumulation and guard.accumulation == 2 * accumulation
    assert guard.events == [{"step": step, "reason": METAL_MESSAGE, "batch_size": 16 // accumulation,
                             "gradient_accumulation": 2 * accumulation, "gradient_checkpointing": False}]
    _, reference = _train(digits, 16 // accumulation, 2 * accumulation)
    assert _max_rel_err(recovered, reference) < 1e-5
    mx.random.seed(0)
    untouched = _flat(build_model("mlp", digits["info"]))
    assert _max_rel_err(recovered, untouched) > 1e-3  # it really trained


def test_recovery_goes_down_to_one_sample_then_checkpointing_then_fails_with_advice(digits, capsys):
    simulated = SimulatedOutOfMemory(steps=[2], times=100, message=CPU_MESSAGE)
    after_step_1 = {}

    class Snapshot:
        def on_batch_end(self, trainer, step):
            after_step_1.update(_flat(trainer.model))

    with pytest.raises(OutOfMemoryError, match=r"(?s)out of memory at step 2: \[malloc\] Unable to allocate .*; "
                                               r"tried down to micro-batch 1 with gradient checkpointing\. "
                                               r"What to try:.*precision='bfloat16'.*'mlx-train optimize'"):
        _train(digits, 8, 1, [Snapshot(), simulated], steps=4)
    out = capsys.readouterr().out
    assert "micro-batch 4 x accumulation 2" in out and "micro-batch 1 x accumulation 8" in out
    assert "gradient checkpointing on" in out
    assert simulated.failures == [2] * 5  # 8, 4, 2, 1, 1 with checkpointing


def test_without_recovery_the_error_says_so_and_the_step_is_undone(digits):
    keys, params = [], {}

    class Snapshot:
        def on_batch_end(self, trainer, step):
            keys.append(rng_key())
            params.update(_flat(trainer.model))

    mx.random.seed(0)
    model = build_model("mlp", digits["info"], dropout=0.3)  # the step draws random numbers
    trainer = Trainer(model, optim.Adam(1e-3), batch_size=32, max_steps=5, oom_recovery=False,
                      report_every="1000 steps", num_workers=0)
    with pytest.raises(OutOfMemoryError, match=r"out of memory at step 2: .*tried down to oom_recovery is off"):
        trainer.train(digits["train"], epochs=1, callbacks=[Snapshot(), SimulatedOutOfMemory([2])])
    assert trainer.step == 1
    assert rng_key() == keys[-1]  # the failed step's random draws are undone too
    assert _max_rel_err(_flat(model), params) == 0.0


def _text_run(data, batch_size, accumulation, steps, checkpoint_dir=None, resume=None, dropout=0.0, **options):
    """A char transformer run; (trainer, the peak of each step, parameters). Each step's peak is measured
    from a reset right before it (the first one: before the memory guard's planning too)."""
    gc.collect()
    mx.clear_cache()
    mx.random.seed(0)
    model = build_model("transformer", data["info"], dropout=dropout)
    # SGD with momentum: optimizer state to restore, and an update that carries rounding differences as
    # they are (Adam's normalisation magnifies them for near-zero gradients)
    trainer = Trainer(model, optim.SGD(0.1, momentum=0.9), batch_size=batch_size, gradient_accumulation=accumulation,
                      max_steps=steps, report_every="1000 steps", num_workers=0, shuffle=False, **options)
    peaks = {}

    class Peak:
        def on_epoch_start(self, trainer, epoch):
            mx.reset_peak_memory()

        def on_batch_end(self, trainer, step):
            peaks[step] = mx.get_peak_memory()
            mx.reset_peak_memory()

    trainer.train(data["train"], epochs=1, callbacks=[Peak()], checkpoint_dir=checkpoint_dir, resume=resume)
    return trainer, peaks, _flat(model)


@pytest.fixture(scope="module")
def text_limit():
    """The text data, and a memory_limit below what micro-batches 64 and 32 need, above 16."""
    data = load_dataset("text", seed=0)
    peak_64 = _text_run(data, 64, 1, 1)[1][1]
    peak_16 = _text_run(data, 16, 1, 1)[1][1]
    return data, (peak_16 + peak_64) // 3


@pytest.mark.slow
def test_a_memory_limit_holds_from_the_first_step_with_the_same_effective_batch(text_limit, capsys):
    data, limit = text_limit
    _, _, unlimited = _text_run(data, 64, 1, 3)
    trainer, peaks, params = _text_run(data, 64, 1, 3, memory_limit=limit)
    assert peaks[1] < limit, f"the first step peaked at {peaks[1]} bytes, over the limit of {limit}"
    assert max(peaks.values()) < limit
    assert trainer.step == 3
    assert [e["batch_size"] for e in trainer.memory_guard.events] == [16]
    assert trainer.memory_guard.accumulation == 4 and trainer.memory_guard.events[0]["step"] == 1
    assert _max_rel_err(params, unlimited) < 1e-5  # batch 16 x accumulation 4 == batch 64
    assert "starting with micro-batch 16 x accumulation 4 (same effective batch)" in capsys.readouterr().out

    # DeviceConfig(memory_limit=...) is a budget as well.
    trainer, peaks, _ = _text_run(data, 64, 1, 2, device_config=DeviceConfig(memory_limit=limit))
    assert trainer.memory_guard.budget == limit and trainer.memory_guard.batch_size < 64 and peaks[1] < limit
    mx.set_memory_limit(DeviceConfig().info().memory_total or mx.get_memory_limit())


def _decisions(trainer):
    return [{k: v for k, v in event.items() if k != "reason"} for event in trainer.memory_guard.events]


@pytest.mark.slow
def test_memory_limit_decisions_are_the_same_in_identical_and_resumed_runs(text_limit, tmp_path):
    data, limit = text_limit
    first, _, params = _text_run(data, 64, 1, 4, str(tmp_path / "a"), memory_limit=limit, dropout=0.1)
    second, _, again = _text_run(data, 64, 1, 4, str(tmp_path / "b"), memory_limit=limit, dropout=0.1)
    # The same decisions (the numbers in the reasons differ by what this process still holds of the first run).
    assert _decisions(first) == _decisions(second) != []
    assert all(np.array_equal(params[k], again[k]) for k in params)

    _text_run(data, 64, 1, 2, str(tmp_path / "c"), memory_limit=limit, dropout=0.1)  # stopped after step 2
    resumed, _, after = _text_run(data, 64, 1, 4, str(tmp_path / "c"), "auto", memory_limit=limit, dropout=0.1)
    assert _decisions(resumed) == _decisions(first)
    assert resumed.memory_guard.settings()["checked"] == first.memory_guard.settings()["checked"]
    assert all(np.array_equal(params[k], after[k]) for k in params)


def _held(digits):
    """The digits MLP's weights, gradients and Adam state, in bytes (what no micro-batch can shed)."""
    weights = sum(v.nbytes for _, v in tree_flatten(build_model("mlp", digits["info"]).parameters()))
    return weights * 4  # weights, gradients, and Adam's two moments


def test_an_unreachable_budget_fails_with_the_budget_in_the_message(digits):
    budget = _held(digits) + 1000  # above what is held, below any step's peak (the update copies the weights)
    with pytest.raises(OutOfMemoryError, match=r"(?s)is over the memory_limit budget of .*; tried down to "
                                               r"micro-batch 1 with gradient checkpointing.*a larger "
                                               r"memory_limit than "):
        _train(digits, 4, 1, steps=10, memory_limit=budget)


# MLX's SGD keeps a velocity per weight even without momentum
@pytest.mark.parametrize("optimizer, state_per_weight", [(optim.Adam, 2), (optim.SGD, 1)])
def test_a_budget_below_the_weights_gradients_and_optimizer_state_is_refused_before_the_first_step(
        digits, optimizer, state_per_weight):
    mx.random.seed(0)
    model = build_model("mlp", digits["info"])
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    before = _flat(model)
    held = weights * (2 + state_per_weight)
    trainer = Trainer(model, optimizer(learning_rate=1e-3), batch_size=4, max_steps=2, num_workers=0,
                      memory_limit=held - 1)
    size = f"{weights / 1e3:.2f} KB"
    with pytest.raises(OutOfMemoryError, match=rf"below what training holds at any micro-batch, .* \(weights {size}, "
                                               rf"gradients {size}, optimizer state "
                                               rf"{weights * state_per_weight / 1e3:.2f} KB\), before any activation"):
        trainer.train(digits["train"], epochs=1)
    assert trainer.step == 0 and all(np.array_equal(before[k], v) for k, v in _flat(model).items())
    with pytest.raises(OutOfMemoryError, match=r"below what training holds"):  # the 1 KB of a budget far too small
        _train(digits, 4, 1, steps=10, memory_limit="1KB")


def test_a_failure_of_a_shape_that_ran_well_within_memory_says_to_resume(digits):
    # Steps 1-2 prepared to be undone; step 6 (same shape, far from the device's memory) did not.
    with pytest.raises(OutOfMemoryError, match=r"out of memory at step 6 \(\[metal::malloc\].*\), although steps of "
                                               r"this shape ran before .* Resume from the last checkpoint, and set "
                                               r"memory_limit"):
        _train(digits, 32, 1, [SimulatedOutOfMemory([6])])


def test_the_settled_micro_batch_carries_over_to_the_next_train_call(digits):
    trainer, _ = _train(digits, 32, 1, [SimulatedOutOfMemory([2])], steps=3)
    trainer.config = trainer.config.replace(max_steps=5)
    trainer.train()
    assert trainer.step == 5 and trainer.memory_guard.batch_size == 16 and len(trainer.memory_guard.events) == 1


def test_evaluation_out_of_memory_says_to_lower_the_eval_batch(digits):
    class Hungry(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(64, 10)

        def __call__(self, x):
            if not self.training:
                raise RuntimeError(CPU_MESSAGE)
            return self.layer(x)

    # Not compiled: an error while mx.compile traces would leave MLX's random state half-traced.
    trainer = Trainer(Hungry(), optim.SGD(0.1), compile=False)
    with pytest.raises(OutOfMemoryError, match=r"out of memory during evaluation: .* set a smaller eval_batch_size"):
        trainer.evaluate(digits["val"])


def _launcher():
    path = shutil.which("mlx.launch") or os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    assert os.path.exists(path), "mlx.launch (installed with mlx) was not found"
    return path


def _ranks(out):
    events = [json.load(open(out / f"events-rank{r}.json")) for r in range(2)]
    params = [{k: np.array(v) for k, v in mx.load(str(out / f"params-rank{r}.safetensors")).items()}
              for r in range(2)]
    return events, params


def _launched(out, *options, ranks=2):
    """Run oom_run.py (on ``ranks`` ranks, each with one BLAS thread); returns ``_ranks(out)`` (rank 0's
    parameters alone for one process)."""
    command = [sys.executable, SCRIPT, str(out), *options]
    if ranks > 1:
        command = [_launcher(), "-n", str(ranks), "--", *command]
    subprocess.run(command, check=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}, timeout=300,
                   stdout=subprocess.DEVNULL)
    if ranks == 1:
        return {k: np.array(v) for k, v in mx.load(str(out / "params-rank0.safetensors")).items()}
    return _ranks(out)


@pytest.mark.slow
@pytest.mark.distributed
def test_all_ranks_take_the_same_decision(tmp_path):
    reference = _launched(tmp_path / "one", ranks=1)

    # Step 2 fails on both ranks before the gradient exchange; step 4 fails on rank 1 alone, after it:
    # every rank redoes both steps with half the micro-batch (16 -> 8 -> 4 per rank).
    events, params = _launched(tmp_path / "fail", "--fail", "0:2", "--fail", "1:2", "--fail", "1:4:late")
    assert [e["outcome"] for e in events] == ["finished", "finished"] and events[0]["step"] == 6
    assert [[(e["step"], e["batch_size"]) for e in rank["events"]] for rank in events] == [[(2, 8), (4, 4)]] * 2
    assert [e["reason"] for e in events[0]["events"]] == [METAL_MESSAGE, "another rank ran out of memory"]
    assert [e["reason"] for e in events[1]["events"]] == [METAL_MESSAGE, METAL_MESSAGE]
    assert all(np.array_equal(params[0][k], params[1][k]) for k in params[0])
    assert _max_rel_err(params[0], reference) < 1e-5

    # Only rank 0 has a (hopeless) budget: both ranks shrink together, then stop at the same step.
    events, params = _launched(tmp_path / "budget", "--budget-rank", "0")
    assert all(e["outcome"].startswith("OutOfMemoryError: out of memory at step") for e in events)
    assert events[0]["step"] == events[1]["step"] and events[0]["events"] == [
        {**e, "reason": events[0]["events"][i]["reason"]} for i, e in enumerate(events[1]["events"])]
    assert "another rank went over its memory_limit" in events[1]["events"][0]["reason"]
    assert all(np.array_equal(params[0][k], params[1][k]) for k in params[0])

    # Rank 0's budget is below its weights, gradients and optimizer state: both ranks stop before a step.
    events, _ = _launched(tmp_path / "floor", "--budget-rank", "0", "--budget", "1000")
    assert [e["step"] for e in events] == [0, 0]
    assert "below what training holds at any micro-batch" in events[0]["outcome"]
    assert "another rank's memory_limit is below what training holds" in events[1]["outcome"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_runs_out_of_memory_alone_before_the_all_reduce_is_retried_on_every_rank(tmp_path):
    reference = _launched(tmp_path / "one", ranks=1)

    # Rank 1 alone fails at step 3 before its all-reduce (a step past its shape's first two, which no rank
    # asked to check after the update): it joins rank 0's all-reduce with its vote, rank 0 skips its update,
    # and both retry the step with the same micro-batch.
    events, params = _launched(tmp_path / "fail", "--fail", "1:3")
    assert [e["outcome"] for e in events] == ["finished", "finished"] and events[0]["step"] == 6
    assert [[(e["step"], e["batch_size"]) for e in rank["events"]] for rank in events] == [[(3, 8)]] * 2
    assert [rank["events"][0]["reason"] for rank in events] == ["another rank ran out of memory", METAL_MESSAGE]
    assert all(np.array_equal(params[0][k], params[1][k]) for k in params[0])
    assert _max_rel_err(params[0], reference) < 1e-5

    # After its all-reduce, on such a step, the other rank has applied it: the run ends, with advice (and the
    # other rank, left alone, with the lost connection).
    events, _ = _launched(tmp_path / "late", "--fail", "0:3:late")
    assert events[0]["outcome"].startswith("OutOfMemoryError: out of memory at step 3 on this rank after the "
                                           "step's all-reduce") and events[0]["step"] == 2
    assert events[1]["outcome"].startswith("DistributedError") and events[0]["events"] == events[1]["events"] == []

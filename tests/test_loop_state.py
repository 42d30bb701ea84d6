"""LoopState round trips, the Meter with an injected clock, the memory guard with a fake step, callbacks."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train.errors import CheckpointError, OutOfMemoryError
from mlx_train.training.callbacks import Callback, CallbackList
from mlx_train.training.losses import METRIC_PREFIX
from mlx_train.training.meter import Meter, report_window
from mlx_train.training.oom import CPU_MESSAGE, MemoryGuard, MemoryPolicy
from mlx_train.training.state import LoopState, assign_leaves, saved_parameters


class Block(nn.Module):
    """A layer with a parameterless submodule (dropout) next to a linear one."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.linear = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def __call__(self, x):
        return self.act(self.linear(self.dropout(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [Block(), Block()]
        self.head = nn.Linear(4, 2)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Loader:
    epoch = 1

    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {"position": 3}

    def load_state_dict(self, state):
        self.loaded = state


class Config:
    def to_dict(self):
        return {"seed": 0}


def _trained(frozen: bool):
    mx.random.seed(0)
    model = Net()
    if frozen:
        model.freeze()
        model.layers[1].unfreeze()
    optimizer = optim.AdamW(1e-2)
    optimizer.init(model.trainable_parameters())
    grads = nn.value_and_grad(model, lambda m: m(mx.ones((2, 4))).sum())(model)[1]
    optimizer.update(model, grads)
    mx.eval(model.parameters(), optimizer.state)
    return model, optimizer


def _flat(tree):
    return {k: np.array(v) for k, v in tree_flatten(tree)}


@pytest.mark.parametrize("frozen", [False, True])
def test_capture_and_restore_round_trip_any_tree_in_place(frozen):
    model, optimizer = _trained(frozen)
    state = LoopState(step=7, epoch=1, history={"train_loss": [1.0]}, trained_samples=56)
    state.running = {"loss_sum": mx.array(3.5), "items": mx.array(7.0)}
    arrays, saved = state.capture(model, optimizer, Loader(), CallbackList([]), Config(), {"loss_sum": 3.5,
                                                                                          "items": 7.0})
    expected_model, expected_opt = _flat(model.parameters()), _flat(optimizer.state)
    if frozen:  # only trainable parameters are saved
        assert set(arrays["model"]) == set(dict(tree_flatten(model.trainable_parameters())))
        assert len(arrays["model"]) < len(expected_model)
        assert saved["model_scope"] == "trainable"

    fresh_model, fresh_optimizer = Net(), optim.AdamW(1e-2)
    if frozen:
        fresh_model.freeze()
        fresh_model.layers[1].unfreeze()
        fresh_model.load_weights(list({k: mx.array(v) for k, v in expected_model.items()}.items()))
    fresh_optimizer.init(fresh_model.trainable_parameters())
    containers = (fresh_optimizer.state, fresh_optimizer.state["layers"])
    restored, loader = LoopState(), Loader()
    restored.restore("ckpt", arrays, saved, fresh_model, fresh_optimizer, loader, CallbackList([]))

    assert containers[0] is fresh_optimizer.state and containers[1] is fresh_optimizer.state["layers"]
    assert "dropout" in fresh_optimizer.state["layers"][0]  # empty subtrees kept: the update still works
    assert _flat(fresh_model.parameters()).keys() == expected_model.keys()
    assert all(np.array_equal(_flat(fresh_model.parameters())[k], v) for k, v in expected_model.items())
    assert all(np.array_equal(_flat(fresh_optimizer.state)[k], v) for k, v in expected_opt.items())
    assert (restored.step, restored.epoch, restored.history, restored.trained_samples) == (7, 1, {"train_loss": [1.0]},
                                                                                           56)
    assert float(restored.running["loss_sum"].item()) == 3.5 and loader.loaded == {"position": 3}
    grads = nn.value_and_grad(fresh_model, lambda m: m(mx.ones((2, 4))).sum())(fresh_model)[1]
    fresh_optimizer.update(fresh_model, grads)  # would raise KeyError with a lost subtree
    mx.eval(fresh_model.parameters())


def test_restore_off_rank_zero_starts_running_sums_at_zero():
    model, optimizer = _trained(False)
    state = LoopState(step=2)
    sums = {"loss_sum": 4.0, "items": 2.0, METRIC_PREFIX + "reward_accuracy": 1.5}  # a loss's metric sums too
    arrays, saved = state.capture(model, optimizer, Loader(), CallbackList([]), Config(), sums)
    restored = LoopState()
    restored.restore("ckpt", arrays, saved, model, optimizer, Loader(), CallbackList([]), rank=1)
    assert {k: float(v.item()) for k, v in restored.running.items()} == dict.fromkeys(sums, 0.0)


def test_a_different_base_model_is_refused():
    model, optimizer = _trained(True)
    state = LoopState(base_model={"path": "base-a", "sha256": "a" * 64})
    arrays, saved = state.capture(model, optimizer, Loader(), CallbackList([]), Config(), {})
    other = LoopState(base_model={"path": "base-b", "sha256": "b" * 64})
    with pytest.raises(CheckpointError, match="was trained on base model base-a .* needs the same base"):
        other.restore("ckpt", arrays, saved, model, optimizer, Loader(), CallbackList([]))


def test_assign_leaves_writes_through_lists_and_dicts():
    tree = {"a": [{"w": 1}, {"w": 2}], "b": {}}
    assign_leaves(tree, {"a.1.w": 5})
    assert tree == {"a": [{"w": 1}, {"w": 5}], "b": {}}


def test_saved_parameters_are_all_of_them_without_frozen_parts():
    model, _ = _trained(False)
    assert saved_parameters(model).keys() == dict(tree_flatten(model.parameters())).keys()


# -- the meter ------------------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_meter_splits_time_and_reports_the_window_loss():
    clock, state = FakeClock(), LoopState()
    meter = Meter(state, world_size=2, clock=clock, peak_memory=lambda: 2e9, reset_peak=lambda: None)

    def loader():
        for _ in range(2):
            clock.now += 0.5  # waiting for data
            yield (np.zeros((4, 3)),)

    for batch in meter.timed(loader()):
        clock.now += 1.0  # the step
        state.advance({}, meter.count(batch))
    meter.pause()
    clock.now += 10.0  # validation: not counted
    meter.resume()
    totals = {"loss_sum": 12.0, "items": 6.0}
    window = report_window(totals, state.report_base)
    logs = meter.report(window, learning_rate=0.1)
    assert state.report_base == {"loss_sum": 0.0, "items": 0.0, "step": 0}  # the meter only reads the state
    state.close_window(totals, window["items"])
    assert logs["loss"] == 2.0 and logs["steps_per_second"] == pytest.approx(2 / 3.0)
    assert logs["time_data"] == pytest.approx(0.5) and logs["time_compute"] == pytest.approx(1.0)
    assert logs["samples_per_second"] == pytest.approx(16 / 3.0) and state.trained_samples == 16
    assert logs["peak_memory_gb"] == 2.0 and state.step == 2
    # the next window starts from the reported totals
    state.advance({}, meter.count((np.zeros((4, 3)),)))
    assert meter.report(report_window({"loss_sum": 15.0, "items": 9.0}, state.report_base), 0.1)["loss"] == 1.0
    assert state.report_base == {"loss_sum": 12.0, "items": 6.0, "step": 2}


# -- the memory guard -----------------------------------------------------------------------

class FakeStep:
    """A step that runs out of memory while its micro-batch is larger than ``fits``."""

    def __init__(self, accumulation, fits, counter, log):
        self.accumulation, self.fits, self.log = accumulation, fits, log
        self.model, self.optimizer = nn.Linear(2, 2), optim.SGD(0.1)
        self.options = type("O", (), {"precision": "float32"})()
        self.state = [counter]
        self.votes = None  # one process: no all-reduce to vote in

    def __call__(self, state, batch):
        micro = -(-batch[0].shape[0] // self.accumulation)
        self.state[0]["n"] = self.state[0]["n"] + 1  # a change the guard must undo on failure
        self.log.append(micro)
        if micro > self.fits:
            raise RuntimeError(CPU_MESSAGE)
        return {"loss_sum": mx.array(1.0), "items": mx.array(float(batch[0].shape[0]))}


def test_the_guard_retries_the_same_batch_with_half_the_micro_batch():
    counter, calls, messages = {"n": mx.array(0)}, [], []
    guard = MemoryGuard(lambda acc, ckpt: FakeStep(acc, 8, counter, calls), 1, MemoryPolicy(), log=messages.append)
    state = LoopState()
    guard(state, (mx.zeros((32, 2)),))
    assert calls == [32, 16, 8]
    assert int(counter["n"].item()) == 1  # the two failed attempts were undone
    assert guard.batch_size == 8 and guard.accumulation == 4
    settings = guard.settings()
    assert settings["batch_size"] == 8 and settings["gradient_accumulation"] == 4
    assert "retrying the same step with micro-batch 16" in messages[0]
    # a new guard built from the saved settings starts where this one settled
    resumed = MemoryGuard(lambda acc, ckpt: FakeStep(acc, 8, counter, calls), 1, MemoryPolicy(),
                          settings=settings)
    calls.clear()
    resumed(state, (mx.zeros((32, 2)),))
    assert calls == [8]


def test_the_guard_gives_up_with_advice_at_micro_batch_one():
    guard = MemoryGuard(lambda acc, ckpt: FakeStep(acc, 0, {"n": mx.array(0)}, []), 1, MemoryPolicy(),
                        log=lambda m: None)
    with pytest.raises(OutOfMemoryError, match="tried down to micro-batch 1 .* What to try"):
        guard(LoopState(), (mx.zeros((4, 2)),))


def test_without_recovery_the_first_failure_is_the_error():
    guard = MemoryGuard(lambda acc, ckpt: FakeStep(acc, 1, {"n": mx.array(0)}, []), 1, MemoryPolicy(recover=False))
    with pytest.raises(OutOfMemoryError, match="oom_recovery is off"):
        guard(LoopState(), (mx.zeros((4, 2)),))


class MeasuredStep(FakeStep):
    """A step whose memory grows by ``allocations[i]`` bytes on its i-th call (probes before the first
    step allocate a kilobyte a sample): later steps of a shape vary, as MLX's do."""

    def __init__(self, accumulation, allocations, calls):
        super().__init__(accumulation, 1 << 30, {"n": mx.array(0)}, calls)
        self.allocations = allocations

    def zero_running(self):
        return {"loss_sum": mx.array(0.0), "items": mx.array(0.0)}

    def __call__(self, state, batch):
        size = batch[0].shape[0] * 1024 if not isinstance(state, LoopState) else self.allocations.pop(0)
        mx.eval(mx.zeros((size // 4,), dtype=mx.float32).sum())
        return super().__call__(state, batch)


def test_budget_decisions_come_from_the_first_step_of_a_shape_and_carry_over_a_resume():
    import gc

    gc.collect()
    mx.clear_cache()
    mb = 1 << 20
    allocations, calls = [2 * mb, 8 * mb, 2 * mb], []
    budget = mx.get_active_memory() + 5 * mb
    policy = MemoryPolicy(budget=budget)
    guard = MemoryGuard(lambda acc, ckpt: MeasuredStep(acc, allocations, calls), 1, policy, log=lambda m: None)
    state = LoopState()
    for _ in range(3):  # the second step of the shape peaks over the budget: noise, not a decision
        state.advance(guard(state, (mx.zeros((16, 2)),)), 16)
    assert guard.events == [] and guard.batch_size is None
    # Resumed from the recorded settings, the shape's first step here is not measured again.
    allocations[:] = [8 * mb]
    resumed = MemoryGuard(lambda acc, ckpt: MeasuredStep(acc, allocations, calls), 1, policy,
                          settings=guard.settings(), log=lambda m: None)
    resumed(state, (mx.zeros((16, 2)),))
    assert resumed.events == []
    # A new shape's first step is measured: over the budget, the next steps shrink.
    allocations[:] = [8 * mb]
    resumed(state, (mx.zeros((12, 2)),))
    assert [e["batch_size"] for e in resumed.events] == [6]


# -- callbacks ------------------------------------------------------------------------------

def test_callback_list_calls_only_overridden_events_and_round_trips_state():
    class Counter(Callback):
        def __init__(self):
            self.batches, self.weights = 0, mx.array([1.0, 2.0])

        def on_batch_end(self, trainer, step):
            self.batches += 1

        def state_dict(self):
            return {"batches": self.batches, "weights": self.weights}

        def load_state_dict(self, state):
            self.batches, self.weights = state["batches"], state["weights"]

    first, second = Counter(), Counter()
    callbacks = CallbackList([first, second])
    assert callbacks.has("on_batch_end") and not callbacks.has("on_epoch_end")
    callbacks.call("on_batch_end", None, 1)
    assert first.batches == second.batches == 1
    json_state, arrays = callbacks.state()
    assert set(json_state) == {"Counter", "Counter_1"} and set(arrays) == {"Counter/weights", "Counter_1/weights"}
    fresh = CallbackList([Counter(), Counter()])
    fresh.load_state(json_state, arrays)
    assert fresh.callbacks[1].batches == 1 and np.array_equal(np.array(fresh.callbacks[1].weights), [1.0, 2.0])


def test_validation_weights_are_swapped_in_and_back():
    model = nn.Linear(2, 1)
    trained = np.array(model.weight)

    class Average(Callback):
        def validation_weights(self):
            return {"weight": mx.zeros((1, 2))}

    with CallbackList([Average()]).validation_weights(model):
        assert float(mx.abs(model.weight).sum().item()) == 0.0
    assert np.array_equal(np.array(model.weight), trained)


# -- the history in checkpoints ----------------------------------------------------------------


@pytest.fixture
def chunk(monkeypatch):
    """A small history chunk, so that a few epochs fill several (the default is the same code, larger)."""
    from mlx_train.training import state

    monkeypatch.setattr(state, "HISTORY_CHUNK", 4)
    return 4


def _history_run(epochs, checkpoint_dir, resume=None, keep_last=1000):
    """A one-step-per-epoch run saving every epoch; (history, parameters)."""
    from mlx_train.training import Trainer

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))
    trainer = Trainer(model, optim.SGD(0.1), batch_size=8, num_workers=0, checkpoint_every="1 epochs",
                      keep_last=keep_last, report_every="100000 steps", seed=0)
    history = trainer.train((x, y), (x, y), epochs=epochs, checkpoint_dir=checkpoint_dir, resume=resume)
    return history, {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def _state_file(checkpoint):
    import json

    from mlx_train.checkpointing.storage import open_store, split_location

    parent, name = split_location(checkpoint)
    data = open_store(parent).read_bytes(f"{name}/trainer_state.json")
    return len(data), json.loads(data)


def test_trainer_state_json_does_not_grow_with_the_epochs_run(tmp_path, chunk):
    from mlx_train.checkpointing import CheckpointManager

    sizes = {}
    for epochs in (3, 3 + 16 * chunk):
        _history_run(epochs, str(tmp_path / str(epochs)))
        sizes[epochs], state = _state_file(CheckpointManager(str(tmp_path / str(epochs))).resolve("auto"))
        assert len(state["history"]["train_loss"]) == 3  # older entries are in chunk files
    # 64 more epochs of history (~7 KB when inline) change only counters' digits and the chunk's name.
    assert sizes[3 + 16 * chunk] - sizes[3] < 100, sizes


@pytest.mark.parametrize("directory", ["local", "memory"])
def test_history_after_a_resume_equals_the_uninterrupted_run(tmp_path, directory, chunk):
    where = str(tmp_path / "ck") if directory == "local" else f"memory://history-{tmp_path.name}/ck"
    epochs = 5 * chunk + 1
    full_history, full_params = _history_run(epochs, str(tmp_path / "full"))
    _history_run(2 * chunk + 2, where)  # stopped after two chunks and two entries
    history, params = _history_run(epochs, where, resume="auto")  # no run_dir: the history is in `where` only
    assert len(history["train_loss"]) == epochs
    assert history == full_history
    assert all(np.array_equal(params[k], full_params[k]) for k in full_params)


def test_a_resume_from_an_older_checkpoint_takes_its_own_history(tmp_path, chunk):
    from mlx_train.checkpointing.format import step_name

    epochs = 4 * chunk + 1
    full_history, _ = _history_run(epochs, str(tmp_path / "full"))
    where = str(tmp_path / "ck")
    _history_run(epochs, where)  # its chunks go past the older checkpoint's
    older = f"{where}/{step_name(chunk + 3)}"
    history, _ = _history_run(epochs, where, resume=older)
    assert history == full_history


@pytest.mark.parametrize("damage", ["missing", "damaged"])
def test_a_lost_history_chunk_leaves_the_checkpoint_restorable(tmp_path, chunk, damage):
    """The history is a record, not training state: without a chunk the run resumes bit-exact, with a warning
    naming the file, its newest history entries, and a new chain of chunks that a later resume reads whole."""
    import glob
    import os

    from mlx_train.checkpointing.format import step_name
    from mlx_train.training.state import HistoryWarning

    epochs = 3 * chunk
    full_history, full_params = _history_run(epochs, str(tmp_path / "full"))
    where = tmp_path / "ck"
    _history_run(2 * chunk + 2, str(where))
    oldest = min(glob.glob(str(where / "history" / "*.json")), key=os.path.getmtime)
    if damage == "missing":
        os.remove(oldest)
    else:
        with open(oldest, "r+b") as file:
            file.write(b"X")  # the first byte of its JSON
    with pytest.warns(HistoryWarning, match=rf"needs the history file .*history/[0-9a-f]{{64}}\.json, which is "
                                            rf"{damage}.*weights, optimizer and loop state are intact.*keeps only its "
                                            r"newest \d+ entries"):
        history, params = _history_run(epochs, str(where), resume=str(where / step_name(2 * chunk + 2)))
    assert all(np.array_equal(params[k], full_params[k]) for k in full_params)  # training itself is exact
    kept = len(history["train_loss"])
    assert 0 < kept < epochs and history["train_loss"] == full_history["train_loss"][-kept:]
    # The next resume reads the new chain whole: no warning, the same entries.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", HistoryWarning)
        again, _ = _history_run(epochs + 1, str(where), resume=str(where / step_name(epochs)))
    assert again["train_loss"][:kept] == history["train_loss"]

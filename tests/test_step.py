"""The step builder on tiny trees: item-weighted accumulation, the float16 skip, the reduction hook."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train.training.losses import Loss
from mlx_train.training.state import LoopState
from mlx_train.training.step import Reduction, StepOptions, build_step, split_batch


def _model(seed=0):
    mx.random.seed(seed)
    return nn.Linear(3, 1)


def _squared(model, batch):
    """Sum-of-squares loss averaged over the unmasked items: returns (loss, n_items)."""
    x, y, mask = batch
    err = (model(x).squeeze(-1) - y) ** 2 * mask
    n = mask.sum()
    return err.sum() / n, n


def _run(accumulation, batch, compile=True, **options):
    model = _model()
    optimizer = optim.SGD(0.1)
    optimizer.init(model.trainable_parameters())
    state = LoopState()
    step = build_step(model, optimizer, Loss(_squared), StepOptions(accumulation=accumulation, compile=compile,
                                                                   **options), state.loss_scale)
    state.running = step.zero_running()
    state.running = step(state, batch)
    return model, state


def _batch():
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((8, 3)).astype(np.float32))
    y = mx.array(rng.standard_normal(8).astype(np.float32))
    # Uneven masks: the micro-batches average over different item counts (5 of the first 4, 1 of the last 4).
    mask = mx.array(np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32))
    return x, y, mask


@pytest.mark.parametrize("compile", [True, False])
def test_accumulation_weights_micro_batches_by_their_items(compile):
    batch = _batch()
    whole, state_whole = _run(1, batch, compile)
    parts, state_parts = _run(2, batch, compile)
    for (_, a), (_, b) in zip(tree_flatten(whole.parameters()), tree_flatten(parts.parameters()), strict=False):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-7)
    # A plain mean of the two micro-batch gradients would weight the 1-item half like the 4-item half.
    naive = _model()
    grads_a = nn.value_and_grad(naive, lambda m, b: _squared(m, b)[0])(naive, split_batch(batch, 2)[0])[1]
    grads_b = nn.value_and_grad(naive, lambda m, b: _squared(m, b)[0])(naive, split_batch(batch, 2)[1])[1]
    naive_w = np.array(naive.weight) - 0.1 * (np.array(grads_a["weight"]) + np.array(grads_b["weight"])) / 2
    assert not np.allclose(naive_w, np.array(parts.weight), rtol=1e-4)
    assert float(state_parts.running["items"].item()) == float(state_whole.running["items"].item()) == 5.0
    assert float(state_parts.running["loss_sum"].item()) == pytest.approx(
        float(state_whole.running["loss_sum"].item()), rel=1e-6)


def test_float16_overflow_skips_the_update_and_halves_the_scale():
    batch = _batch()
    model = _model()
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    optimizer = optim.Adam(0.1)
    optimizer.init(model.trainable_parameters())
    state = LoopState()
    state.loss_scale["scale"] = mx.array(1e38)  # the scaled loss overflows float16
    step = build_step(model, optimizer, Loss(_squared), StepOptions(precision="float16"), state.loss_scale)
    state.running = step.zero_running()
    state.running = step(state, batch)
    after = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert float(state.loss_scale["scale"].item()) == pytest.approx(5e37, rel=1e-3)
    assert int(state.loss_scale["good_steps"].item()) == 0
    # Adam's moments were not advanced by the skipped step
    assert all(float(mx.abs(v).sum().item()) == 0.0 for k, v in tree_flatten(optimizer.state) if k.endswith(("m", "v")))
    # a finite step then applies and counts
    state.loss_scale["scale"] = mx.array(1.0)
    state.running = step(state, batch)
    assert any(not np.array_equal(before[k], np.array(v)) for k, v in tree_flatten(model.parameters()))
    assert int(state.loss_scale["good_steps"].item()) == 1


def test_the_reduction_is_called_inside_the_update_with_the_item_count():
    seen = []

    def reduce(grads, n_items):
        seen.append(n_items is not None)
        return grads, n_items

    model = _model()
    optimizer = optim.SGD(0.1)
    optimizer.init(model.trainable_parameters())
    state = LoopState()
    calls = []
    step = build_step(model, optimizer, Loss(_squared), StepOptions(accumulation=2), state.loss_scale,
                      Reduction(reduce, before_update=lambda: calls.append("armed")))
    state.running = step.zero_running()
    state.running = step(state, _batch())
    assert seen == [True]  # traced once, with the weighting count
    assert calls == ["armed"]  # once per step, before the update micro-batch


def test_extensions_run_after_the_update_inside_the_compiled_step():
    class ZeroFirst:
        def __init__(self):
            self.step_state = {"mask": mx.array([[0.0, 1.0, 1.0]])}

        def in_step(self, model, optimizer):
            model.weight = model.weight * self.step_state["mask"]

    model = _model()
    optimizer = optim.SGD(0.1)
    optimizer.init(model.trainable_parameters())
    state = LoopState()
    extension = ZeroFirst()
    step = build_step(model, optimizer, Loss(_squared), StepOptions(), state.loss_scale, extensions=[extension])
    state.running = step.zero_running()
    for _ in range(3):
        state.running = step(state, _batch())
    assert float(model.weight[0, 0].item()) == 0.0 and float(model.weight[0, 1].item()) != 0.0
    extension.step_state["mask"] = mx.array([[1.0, 0.0, 1.0]])  # changed in place: the compiled step sees it
    state.running = step(state, _batch())
    assert float(model.weight[0, 1].item()) == 0.0


def test_split_batch_keeps_every_item_once():
    x = mx.arange(10)
    parts = split_batch((x, x * 2), 3)
    assert [p[0].shape[0] for p in parts] == [3, 3, 4]
    assert np.array_equal(np.concatenate([np.array(p[0]) for p in parts]), np.arange(10))
    parts = split_batch({"a": x}, 4)
    assert sum(p["a"].shape[0] for p in parts) == 10


def test_each_epoch_starts_from_fresh_zero_sums_whatever_the_last_one_summed():
    model, state = _run(1, _batch(), max_grad_norm=1.0, nonfinite="skip")
    step = build_step(model, optim.SGD(0.1), Loss(_squared), StepOptions(max_grad_norm=1.0, nonfinite="skip"),
                      state.loss_scale)
    first = step.zero_running()
    assert set(first) == {"loss_sum", "items", "window:loss_sum", "window:items", "nonfinite", "grad_norm"}
    first.update(state.running)  # an epoch's sums written into the dict it started from
    second = step.zero_running()
    assert second is not first and set(second) == set(first)
    assert all(v.item() == 0.0 for v in second.values())
    assert state.running["loss_sum"].item() > 0  # what the first epoch summed is not zero


class _Recorder:
    """A StepObserver that records what it is shown (and can fail a chosen micro-batch)."""

    def __init__(self, fail_at=None):
        self.seen, self.fail_at = [], fail_at

    def before_micro_batch(self, step, batch, update, weighted):
        self.seen.append(("before", int(batch[0].shape[0]), update, weighted))

    def after_micro_batch(self, step, batch, result, update, weighted):
        grads, running = result
        self.seen.append(("after", int(batch[0].shape[0]), update, "loss_sum" in running))
        if len(self.seen) // 2 == self.fail_at:
            raise RuntimeError("injected")


def _observed(accumulation, observer, batch):
    model = _model()
    optimizer = optim.SGD(0.1)
    optimizer.init(model.trainable_parameters())
    state = LoopState()
    step = build_step(model, optimizer, Loss(_squared), StepOptions(accumulation=accumulation), state.loss_scale)
    step.observe(observer)
    step.observe(observer)  # once is enough: shown each micro-batch once
    state.running = step.zero_running()
    state.running = step(state, batch)
    return model, state


@pytest.mark.parametrize("accumulation", [1, 4])
def test_an_observer_sees_every_micro_batch_and_changes_nothing(accumulation):
    x, y, mask = _batch()
    batch = (x, y, mx.ones_like(mask))  # every micro-batch has items
    recorder = _Recorder()
    observed, observed_state = _observed(accumulation, recorder, batch)
    plain, plain_state = _run(accumulation, batch)
    size = 8 // accumulation
    expected = []
    for i in range(accumulation):
        update = i == accumulation - 1
        expected += [("before", size, update, accumulation > 1), ("after", size, update, True)]
    assert recorder.seen == expected
    for (_, a), (_, b) in zip(tree_flatten(observed.parameters()), tree_flatten(plain.parameters()), strict=True):
        assert np.array_equal(np.array(a), np.array(b))
    assert float(observed_state.running["loss_sum"].item()) == float(plain_state.running["loss_sum"].item())


def test_an_observer_error_is_the_micro_batch_error():
    with pytest.raises(RuntimeError, match="injected"):
        _observed(4, _Recorder(fail_at=2), _batch())

"""build_optimizer: name -> mlx.optimizers class, hyper-parameters, learning-rate schedule and warmup."""

from __future__ import annotations

import math

import mlx.core as mx  # conftest imported mlx_train (the BLAS preload) first
import mlx.optimizers as optim
import numpy as np
import pytest

from mlx_train.config import TrainConfig
from mlx_train.errors import ConfigError
from mlx_train.optim import OPTIMIZERS, SCHEDULES, build_optimizer


def rates(optimizer, steps: int) -> list[float]:
    """The learning rate each of the first `steps` updates used."""
    params = {"w": mx.zeros((2, 2))}
    used = []
    for _ in range(steps):
        params = optimizer.apply_gradients({"w": mx.ones((2, 2))}, params)
        used.append(optimizer.learning_rate.item())
    return used


def cosine(step: int, init: float, decay_steps: int, end: float) -> float:
    return end + 0.5 * (init - end) * (1 + math.cos(math.pi * min(step, decay_steps) / decay_steps))


def test_constant_rate_is_a_float():
    optimizer = build_optimizer(TrainConfig(learning_rate=0.05))
    assert type(optimizer) is optim.AdamW
    assert rates(optimizer, 3) == pytest.approx([0.05] * 3)


def test_warmup_then_cosine():
    config = TrainConfig(learning_rate=1e-3, warmup_steps=4, warmup_init=1e-4,
                         lr_schedule="cosine_decay", lr_schedule_args=[10, 1e-5])
    expected = [1e-4 + (1e-3 - 1e-4) * s / 4 for s in range(4)]
    expected += [cosine(s, 1e-3, 10, 1e-5) for s in range(12)]
    assert rates(build_optimizer(config), 16) == pytest.approx(expected, rel=1e-5)


def test_warmup_without_schedule_holds_the_rate():
    config = TrainConfig(learning_rate=0.1, warmup_steps=5)
    assert rates(build_optimizer(config), 8) == pytest.approx([0.0, 0.02, 0.04, 0.06, 0.08, 0.1, 0.1, 0.1])


@pytest.mark.parametrize("name, args, expected", [
    ("exponential_decay", [0.5], [1.0, 0.5, 0.25, 0.125]),
    ("step_decay", [0.1, 2], [1.0, 1.0, 0.1, 0.1]),
    ("linear_schedule", [0.0, 4], [1.0, 0.75, 0.5, 0.25]),
    ("cosine_decay", [4], [cosine(s, 1.0, 4, 0.0) for s in range(4)]),
])
def test_schedules_without_warmup(name, args, expected):
    config = TrainConfig(learning_rate=1.0, lr_schedule=name, lr_schedule_args=args, optimizer="sgd")
    assert rates(build_optimizer(config), 4) == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_schedule_args_from_yaml_strings(tmp_path):
    # PyYAML reads 1e-5 as a string; the config coerces it, so the schedule gets a number.
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  learning_rate: 1e-3\n  lr_schedule: cosine_decay\n  lr_schedule_args: [2, 1e-5]\n")
    assert rates(build_optimizer(TrainConfig.from_yaml(path)), 3) == pytest.approx(
        [1e-3, cosine(1, 1e-3, 2, 1e-5), 1e-5], rel=1e-5)


def test_hyper_parameters_reach_the_class():
    betas = {"beta1": 0.8, "beta2": 0.95}
    adamw = build_optimizer(TrainConfig(**betas, epsilon=1e-6, weight_decay=0.1))
    assert (adamw.betas, adamw.eps, adamw.weight_decay) == ([0.8, 0.95], 1e-6, 0.1)
    sgd = build_optimizer(TrainConfig(optimizer="sgd", momentum=0.7, weight_decay=0.1))
    assert type(sgd) is optim.SGD and (sgd.momentum, sgd.weight_decay) == (0.7, 0.1)
    lion = build_optimizer(TrainConfig(optimizer="Lion", **betas, weight_decay=0.1))
    assert type(lion) is optim.Lion and lion.betas == [0.8, 0.95] and lion.weight_decay == 0.1
    adam = build_optimizer(TrainConfig(optimizer="adam", **betas, epsilon=1e-6))
    assert type(adam) is optim.Adam and (adam.betas, adam.eps) == ([0.8, 0.95], 1e-6)
    muon = build_optimizer(TrainConfig(optimizer="muon", momentum=0.7, weight_decay=0.1))
    assert type(muon) is optim.Muon and (muon.momentum, muon.weight_decay) == (0.7, 0.1)
    rmsprop = build_optimizer(TrainConfig(optimizer="rmsprop", epsilon=1e-6))
    assert type(rmsprop) is optim.RMSprop and rmsprop.eps == 1e-6
    adafactor = build_optimizer(TrainConfig(optimizer="adafactor", learning_rate=0.01, weight_decay=0.1))
    assert type(adafactor) is optim.Adafactor and adafactor.relative_step is False
    assert adafactor.weight_decay == 0.1


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_builds_and_updates(name):
    momentum = {"momentum": 0.5} if "momentum" in OPTIMIZERS[name][1] else {}
    optimizer = build_optimizer(TrainConfig(optimizer=name, learning_rate=0.1, **momentum))
    assert type(optimizer).__name__ == OPTIMIZERS[name][0]
    params = {"w": mx.ones((3, 3))}
    new = optimizer.apply_gradients({"w": mx.full((3, 3), 0.5)}, params)
    mx.eval(new)
    assert not mx.array_equal(new["w"], params["w"]).item()  # the parameters moved


def test_the_table_names_real_keyword_arguments():
    # every hyper-parameter an optimizer is said to use really is an argument of its mlx class
    import inspect

    keywords = {"beta1": "betas", "beta2": "betas", "epsilon": "eps", "weight_decay": "weight_decay",
                "momentum": "momentum", "bias_correction": "bias_correction"}
    for name, (class_name, uses) in OPTIMIZERS.items():
        accepted = inspect.signature(getattr(optim, class_name)).parameters
        assert {keywords[u] for u in uses} <= set(accepted), name


def adam_by_hand(params, grads, lr, beta1, beta2, eps, weight_decay, bias_correction):
    """PyTorch's Adam (weight_decay 0) and AdamW update, written out in float64 numpy."""
    m, v, out = np.zeros_like(params), np.zeros_like(params), params.copy()
    for step, g in enumerate(grads, start=1):
        out = out * (1 - lr * weight_decay)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        c1, c2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
        out = out - (lr / c1) * m / (np.sqrt(v) / np.sqrt(c2) + eps)
    return out


@pytest.mark.parametrize("name, weight_decay", [("adam", 0.0), ("adamw", 0.1)])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_bias_correction_matches_the_hand_written_update(name, weight_decay, bias_correction):
    rng = np.random.default_rng(0)
    params = rng.normal(size=(3, 4))
    grads = [rng.normal(size=(3, 4)) for _ in range(5)]
    hyper = {"beta1": 0.8, "beta2": 0.95, "epsilon": 1e-6}
    decay = {"weight_decay": weight_decay} if name == "adamw" else {}
    optimizer = build_optimizer(TrainConfig(optimizer=name, learning_rate=0.01, bias_correction=bias_correction,
                                            **hyper, **decay))
    w = {"w": mx.array(params.astype(np.float32))}
    for g in grads:
        w = optimizer.apply_gradients({"w": mx.array(g.astype(np.float32))}, w)
    expected = adam_by_hand(params, grads, 0.01, 0.8, 0.95, 1e-6, weight_decay, bias_correction)
    np.testing.assert_allclose(np.array(w["w"]), expected, atol=1e-6)


def test_bias_correction_is_off_by_default_and_refused_where_unused(tmp_path):
    # MLX's (and mlx-lm's) Adam: the first update is about 3.2x PyTorch's with beta2 = 0.999
    assert TrainConfig().bias_correction is False and build_optimizer(TrainConfig()).bias_correction is False
    with pytest.raises(ConfigError, match=r"TrainConfig.bias_correction is set to True, but optimizer 'sgd' does "
                                          r"not use bias_correction .*an optimizer that uses it: adam and adamw$"):
        TrainConfig(optimizer="sgd", bias_correction=True)
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  name: sgd\n  bias_correction: false\n")
    with pytest.raises(ConfigError, match=r"c.yaml:3: optimizer.bias_correction is set to False, but optimizer "
                                          r"'sgd' does not use bias_correction"):
        TrainConfig.from_yaml(path)


def test_unknown_names_and_bad_arguments():
    config = TrainConfig()
    config.optimizer = "adamm"  # bypasses the check done when a config is built
    with pytest.raises(ConfigError, match=r"unknown optimizer 'adamm' \(did you mean 'adam'\?\); choose one of"):
        build_optimizer(config)
    config = TrainConfig()
    config.lr_schedule = "cosine"
    with pytest.raises(ConfigError, match=r"unknown lr_schedule 'cosine' \(did you mean 'cosine_decay'\?\)"):
        build_optimizer(config)
    with pytest.raises(ConfigError, match=r"lr_schedule_args \[1, 2, 3\] do not fit lr_schedule 'step_decay', "
                                          r"which takes \(decay_rate, step_size\) after the initial learning rate"):
        build_optimizer(TrainConfig(lr_schedule="step_decay", lr_schedule_args=[1, 2, 3]))
    with pytest.raises(ConfigError, match=r"TrainConfig.optimizer must be one of .* \(did you mean 'adamw'\?\)"):
        TrainConfig(optimizer="adamx_w")
    assert set(SCHEDULES) == set(TrainConfig.fields_help()["lr_schedule"].choices)

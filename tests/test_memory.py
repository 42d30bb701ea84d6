"""MemoryOptimizer: plans that are well-formed, explain themselves, and move the right way with the
inputs; measured calibration that leaves the model alone; the optimize CLI and train --optimize-memory."""

import math
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train import ConfigError, MemoryOptimizer, TrainConfig
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import build_model
from mlx_train.cli.main import main as cli
from mlx_train.memory import HEADROOM, MemoryModel, MemoryPlan, calibrate, optimizer_slots
from mlx_train.training.recompute import is_checkpointed
from mlx_train.training.state import rng_key


def _plan(size=1e9, devices=1, memory="80GB", **kwargs):
    kwargs.setdefault("precision", "bfloat16")
    return MemoryOptimizer.suggest_config(size, devices, device_memory=memory, **kwargs)


def _check(plan: MemoryPlan):
    assert plan.batch_size >= 1 and plan.gradient_accumulation >= 1
    assert plan.effective_batch_size == plan.batch_size * plan.gradient_accumulation * plan.num_devices
    assert plan.budget == int(plan.device_memory * HEADROOM)
    assert plan.peak.total == sum(value for _, value in plan.peak.items())
    assert all(value >= 0 for _, value in plan.peak.items())
    assert plan.fits == (plan.peak.total <= plan.budget)
    assert bool(plan.suggestions) == (not plan.fits)
    text = str(plan)
    for label in ("batch size per device", "gradient accumulation", "gradient checkpointing", "precision",
                  "peak per device", "parameters", "gradients", "optimizer state", "activations", "workspace"):
        assert label in text, label
    assert plan.apply(TrainConfig()).to_dict().items() >= plan.to_config().items()


def test_the_seed_call_gives_a_plan_that_explains_itself():
    plan = MemoryOptimizer.suggest_config(model_size=1e9, num_devices=2)
    _check(plan)
    assert plan.num_devices == 2 and plan.model.parameter_count == 10**9
    assert plan.peak.parameters == 4 * 10**9 and plan.peak.optimizer_state == 8 * 10**9  # float32, AdamW
    assert "1.00B-parameter transformer" in str(plan) and "(analytic estimate)" in str(plan)


def test_a_plan_that_fits_stays_within_the_budget_and_one_that_does_not_says_what_to_try():
    fits = _plan(1e9, 2, "80GB", target_batch_size=256)
    _check(fits)
    assert fits.fits and fits.peak.total <= fits.budget and fits.effective_batch_size == 256
    assert re.search(r"peak per device\s+[\d.]+ GB\s+of a 72.00 GB budget \(90% of 80.00 GB device memory\): fits",
                     str(fits))
    too_big = _plan(7e9, 8, "16GB")
    _check(too_big)
    assert not too_big.fits and "DOES NOT FIT" in str(too_big)
    assert any("the weights, gradients and optimizer state alone take" in tip for tip in too_big.suggestions)
    assert any("optimizer='sgd'" in tip for tip in too_big.suggestions)


def test_plans_move_the_right_way():
    sizes = [_plan(1e9, memory=f"{gb}GB").batch_size for gb in (24, 40, 80, 160, 320, 640)]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]  # more memory: a bigger micro-batch
    sizes = [_plan(125e6, memory=f"{gb}GB", target_batch_size=512).batch_size for gb in (8, 16, 32, 64)]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]

    def fit(checkpointing, size=1e9, precision="bfloat16", optimizer="adamw", tokens=2048):
        return MemoryModel.analytic(size, precision, optimizer, tokens).max_batch_size(72e9, 1, checkpointing)

    for checkpointing in (False, True):  # whether the plan then recomputes depends on the model
        by_model = [fit(checkpointing, size=size) for size in (125e6, 350e6, 1e9, 3e9)]
        assert by_model == sorted(by_model, reverse=True) and by_model[0] > by_model[-1]
        by_length = [fit(checkpointing, tokens=tokens) for tokens in (512, 1024, 2048, 4096)]
        assert by_length == sorted(by_length, reverse=True) and by_length[0] > by_length[-1]
        assert fit(checkpointing, optimizer="sgd") > fit(checkpointing) > fit(checkpointing, precision="float32")
    assert _plan(1e9, optimizer="sgd").batch_size >= _plan(1e9, optimizer="adamw").batch_size
    # Recomputing pays off for the deep model, not for the small one; nor when the target fits anyway.
    assert _plan(1e9).gradient_checkpointing and not _plan(125e6).gradient_checkpointing
    assert not _plan(1e9, memory="640GB", target_batch_size=8).gradient_checkpointing


def test_the_target_batch_is_reached_with_accumulation():
    for target, devices in ((256, 2), (64, 1), (96, 4)):
        plan = _plan(1e9, devices, "40GB", target_batch_size=target)
        _check(plan)
        assert plan.effective_batch_size == target
        assert plan.gradient_accumulation == -(-target // (plan.batch_size * devices))
    plan = _plan(125e6, 1, "80GB", target_batch_size=4)
    assert (plan.batch_size, plan.gradient_accumulation) == (4, 1)


def test_the_memory_model():
    model = MemoryModel.analytic(1e9, "float32", "adamw", 2048)
    one, two = model.estimate(1), model.estimate(2)
    assert two.total > one.total and two.activations > one.activations
    accumulated = model.estimate(1, accumulation=4)
    assert accumulated.gradients == 2 * one.gradients  # the running sum of the micro-batches
    assert model.max_batch_size(model.estimate(8).total) == 8
    assert model.max_batch_size(one.total - 1) == 0
    assert model.estimate(8, checkpointing=True).total < model.estimate(8).total
    assert optimizer_slots("adamw") == 2 and optimizer_slots("sgd") == 0 and optimizer_slots("sgd", 0.9) == 1


def test_bad_inputs_are_config_errors():
    with pytest.raises(ConfigError, match=r"model_size must be a positive number of parameters, got -5"):
        MemoryOptimizer.suggest_config(-5, 1, device_memory="8GB")
    with pytest.raises(ConfigError, match=r"num_devices must be a positive whole number, got 0"):
        MemoryOptimizer.suggest_config(1e9, 0, device_memory="8GB")
    with pytest.raises(ConfigError, match=r"precision must be auto, float32, bfloat16 or float16, got 'fp8'"):
        MemoryOptimizer.suggest_config(1e9, 1, device_memory="8GB", precision="fp8")
    with pytest.raises(ConfigError,
                       match=r"unknown optimizer 'adamz' \(did you mean 'adam'\?\); known: sgd, adam, adamw"):
        MemoryOptimizer.suggest_config(1e9, 1, device_memory="8GB", optimizer="adamz")
    with pytest.raises(ConfigError, match=r"device_memory must be a number of bytes or a size like '8GB'"):
        MemoryOptimizer.suggest_config(1e9, 1, device_memory="lots")


@pytest.mark.slow
def test_measured_mode_calibrates_on_the_real_model_and_leaves_it_alone():
    data = load_dataset("text", seed=0)
    mx.random.seed(0)
    model = build_model("transformer", data["info"], dims=64, num_layers=2)
    before, key = {k: np.array(v) for k, v in tree_flatten(model.parameters())}, rng_key()
    # MemoryOptimizer.measure stops doubling after 30 s per mode, which a busy machine can reach before 16: the
    # calibration it runs, with no time limit
    profile = calibrate.measure(model, data["train"], optimizer="adamw", max_batch_size=16, max_seconds=math.inf)
    assert profile.source == "measured" and profile.sequence_length == data["info"]["block_size"]
    assert profile.can_checkpoint and profile.curves[False].per_sample > profile.curves[True].per_sample > 0
    assert profile.parameter_count == sum(v.size for _, v in tree_flatten(model.parameters()))
    assert {m.batch_size for m in profile.measurements} >= {1, 2, 4, 8, 16}
    assert all(np.array_equal(np.array(v), before[k]) for k, v in tree_flatten(model.parameters()))
    assert rng_key() == key and not any(is_checkpointed(block) for block in model.layers)

    small = MemoryOptimizer.suggest_config(profile, 1, device_memory=int(profile.estimate(32).total / HEADROOM))
    large = MemoryOptimizer.suggest_config(profile, 1, device_memory=int(profile.estimate(256).total / HEADROOM))
    _check(small)
    _check(large)
    assert small.fits and large.fits and 16 <= small.batch_size <= 32 < large.batch_size <= 256
    assert "(measured estimate)" in str(small)
    with pytest.raises(ConfigError, match=r"precision cannot be changed for a measured memory model"):
        MemoryOptimizer.suggest_config(profile, 1, precision="float16")


@pytest.mark.slow
def test_optimize_command_prints_a_plan(capsys, tmp_path):
    assert cli(["optimize", "--model-size", "1e9", "--devices", "2", "--device-memory", "80GB",
                "--precision", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "Memory plan for 1.00B-parameter transformer" in out and "on 2 devices" in out
    assert "to train with it: mlx-train train ... --set batch_size=" in out

    assert cli(["optimize", "--set", "model_options.hidden_dims=[32]", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "Memory plan for MLP, measured" in out and "target 64" in out

    assert cli(["optimize", "--sequence-length", "128"]) == 2
    assert "--sequence-length goes with --model-size" in capsys.readouterr().err


@pytest.mark.slow
def test_train_with_optimize_memory_applies_the_plan_and_batch_size_overrides_it(capsys, tmp_path):
    common = ["train", "--max-steps", "2", "--epochs", "1", "--set", "model_options.hidden_dims=[32]",
              "--set", "memory_limit=1GB", "--optimize-memory"]
    assert cli(common + ["--run-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "Memory plan for MLP" in out and "test: loss" in out
    saved = TrainConfig.from_yaml(tmp_path / "a" / "config.yaml").to_dict()  # written by sections
    assert saved["batch_size"] * saved["gradient_accumulation"] == 32

    assert cli(common + ["--batch-size", "8", "--run-dir", str(tmp_path / "b")]) == 0
    assert re.search(r"batch size per device\s+8\s+as given", capsys.readouterr().out)
    saved = TrainConfig.from_yaml(tmp_path / "b" / "config.yaml").to_dict()  # written by sections
    assert saved["batch_size"] == 8

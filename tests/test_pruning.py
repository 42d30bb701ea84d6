"""Magnitude pruning: the Zhu & Gupta schedule, exact zeros after training (MLP, CNN, transformer),
optimizer moments of pruned weights held at zero, sparsity in reports and metrics.jsonl, clear
errors, and a run SIGKILLed mid-schedule that resumes bit for bit."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train import ConfigError
from mlx_train.builtin.datasets import load_dataset
from mlx_train.builtin.models import CharTransformerLM, build_model
from mlx_train.training import Callback, Pruning, Trainer

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "prune_resume_run.py")


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


def _quiet(**kwargs):
    return {"report_every": "1000 steps", **kwargs}


def _zeros(array):
    return float((np.array(array) == 0).mean())


# -- the schedule --------------------------------------------------------------------------


def test_polynomial_schedule_follows_zhu_and_gupta():
    pruning = Pruning(0.9, start_step=100, end_step=1100, frequency=100, initial_sparsity=0.1)
    steps = [s for s in range(1300) if pruning.sparsity_at(s) is not None]
    assert steps == list(range(100, 1101, 100))
    for s in steps:
        expected = 0.9 + (0.1 - 0.9) * (1 - (s - 100) / 1000) ** 3
        assert pruning.sparsity_at(s) == pytest.approx(expected, abs=1e-12)
    assert pruning.sparsity_at(100) == pytest.approx(0.1) and pruning.sparsity_at(1100) == pytest.approx(0.9)


def test_polynomial_schedule_always_includes_the_end_step():
    pruning = Pruning(0.5, start_step=0, end_step=25, frequency=10)
    assert [s for s in range(40) if pruning.sparsity_at(s) is not None] == [0, 10, 20, 25]


def test_one_shot_prunes_once_at_the_start_step():
    pruning = Pruning(0.7, schedule="one_shot", start_step=30)
    assert [(s, pruning.sparsity_at(s)) for s in range(100) if pruning.sparsity_at(s) is not None] == [(30, 0.7)]


# -- training -----------------------------------------------------------------------------


class WeightsEachStep(Callback):
    """Records the fraction of exact zeros in every pruned tensor after each step."""

    def __init__(self, pruning):
        self.pruning, self.zeros = pruning, []

    def on_batch_end(self, trainer, step):
        params = dict(tree_flatten(trainer.model.parameters()))
        self.zeros.append((step, {n: _zeros(params[n]) for n in self.pruning.step_state["masks"]}))


def test_mlp_pruned_weights_are_exact_zeros_and_stay_zero(digits, tmp_path):
    mx.random.seed(0)
    model = build_model("mlp", digits["info"], hidden_dims=[64])
    pruning = Pruning(0.9, start_step=10, end_step=60, frequency=10)
    watch = WeightsEachStep(pruning)
    trainer = Trainer(model, optim.Adam(3e-3), batch_size=32, run_dir=str(tmp_path), report_every="20 steps")
    history = trainer.train(digits["train"], digits["val"], epochs=3, callbacks=[pruning, watch])

    params = dict(tree_flatten(model.parameters()))
    pruned = [params["layers.0.weight"], params["layers.1.weight"]]
    total_zeros = sum(int((np.array(w) == 0).sum()) for w in pruned)
    assert total_zeros == round(0.9 * sum(w.size for w in pruned))
    assert _zeros(params["layers.0.bias"]) == 0.0 and _zeros(params["layers.1.bias"]) == 0.0
    # Every weight the final mask drops is exactly 0, and no weight that was 0 at the end of the
    # schedule moved afterwards (Adam's moments did not revive it).
    for name, mask in pruning.step_state["masks"].items():
        assert np.all(np.array(params[name])[~np.array(mask)] == 0)
    after_end = [z for step, z in watch.zeros if step >= 60]
    assert after_end and all(z == after_end[0] for z in after_end)
    # Sparsity only grows while the schedule runs.
    totals = [sum(z.values()) for _, z in watch.zeros]
    assert all(a <= b for a, b in zip(totals, totals[1:], strict=False))
    assert history["sparsity"][-1] == pytest.approx(0.9, abs=1e-4)
    assert history["sparsity/layers.0"][-1] == pytest.approx(_zeros(params["layers.0.weight"]))

    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert train_rows[0]["step"] == 20 and 0 < train_rows[0]["sparsity"] < 0.9
    assert {"sparsity/layers.0", "sparsity/layers.1"} <= set(train_rows[-1])
    assert [r for r in rows if r["kind"] == "epoch"][-1]["sparsity"] == pytest.approx(0.9, abs=1e-4)

    from rich.console import Console

    from mlx_train.monitor import RunReader, render

    console = Console(file=io.StringIO(), width=120)
    console.print(render(RunReader(tmp_path).read(), width=120))
    assert re.search(r"sparsity +90\.0%", console.file.getvalue())


def _pruned_moments(optimizer, pruning):
    """(name, moment key, moment values of pruned entries, of kept entries) for every pruned tensor."""
    for name, mask in pruning.step_state["masks"].items():
        layer, index, _ = name.split(".")
        for key, value in optimizer.state[layer][int(index)]["weight"].items():
            keep = np.array(mask)
            yield name, key, np.array(value)[~keep], np.array(value)[keep]


class MomentsAtUpdate(Callback):
    def __init__(self, pruning, optimizer, step):
        self.pruning, self.optimizer, self.step, self.seen = pruning, optimizer, step, []

    def on_batch_end(self, trainer, step):
        if step == self.step:
            self.seen = list(_pruned_moments(self.optimizer, self.pruning))


@pytest.mark.parametrize("make_optimizer", [lambda: optim.AdamW(1e-3), lambda: optim.SGD(0.05, momentum=0.9)])
def test_moments_of_pruned_weights_are_zeroed_every_step_or_at_updates(digits, make_optimizer):
    for zero_moments in ("step", "update"):
        mx.random.seed(1)
        model, optimizer = build_model("mlp", digits["info"], hidden_dims=[32]), make_optimizer()
        pruning = Pruning(0.6, schedule="one_shot", start_step=5, zero_moments=zero_moments)
        at_update = MomentsAtUpdate(pruning, optimizer, 5)
        trainer = Trainer(model, optimizer, batch_size=64, max_steps=15, **_quiet())
        trainer.train(digits["train"], epochs=1, callbacks=[pruning, at_update])
        assert at_update.seen and all(np.all(p == 0) and np.any(k != 0) for _, _, p, k in at_update.seen)
        for name, key, pruned, kept in _pruned_moments(optimizer, pruning):
            assert pruned.size and np.any(kept != 0)
            # "update": the moments of pruned weights grow again, yet the weights stay exactly 0.
            assert np.all(pruned == 0) == (zero_moments == "step"), f"{zero_moments}: {key} of {name}"
        params = dict(tree_flatten(model.parameters()))
        for name, mask in pruning.step_state["masks"].items():
            assert np.all(np.array(params[name])[~np.array(mask)] == 0)


def test_cnn_layer_scope_prunes_each_conv_and_linear_weight(digits, tmp_path):
    mx.random.seed(0)
    model = build_model("cnn", digits["info"], channels=[8, 16], hidden_dims=32)
    pruning = Pruning(0.5, schedule="one_shot", start_step=3, scope="layer")
    trainer = Trainer(model, optim.Adam(1e-3), batch_size=64, max_steps=8, **_quiet())
    trainer.train(digits["train"], epochs=1, callbacks=[pruning], checkpoint_dir=str(tmp_path))
    params = dict(tree_flatten(model.parameters()))
    # What is saved (and exported from a checkpoint) is the pruned weights.
    from mlx_train.checkpointing import load_checkpoint

    saved = load_checkpoint(str(tmp_path / "step-00000008"), groups=["model"])[0]["model"]
    assert all(np.array_equal(np.array(saved[n]), np.array(params[n])) for n in params)
    assert sorted(pruning.step_state["masks"]) == ["convs.0.weight", "convs.1.weight", "head.weight", "hidden.weight"]
    for name in pruning.step_state["masks"]:
        assert int((np.array(params[name]) == 0).sum()) == round(0.5 * params[name].size), name
    assert _zeros(params["convs.0.bias"]) == 0.0


def test_transformer_prunes_linear_weights_not_embeddings_or_norms():
    mx.random.seed(0)
    model = CharTransformerLM(vocab_size=20, dims=16, num_heads=2, num_layers=1, block_size=8)
    tokens = np.random.default_rng(0).integers(0, 20, size=(64, 9)).astype(np.int32)
    pruning = Pruning(0.8, start_step=0, end_step=6, frequency=2)
    trainer = Trainer(model, optim.AdamW(1e-3), batch_size=16, max_steps=8, **_quiet())
    trainer.train({"tokens": tokens}, epochs=2, callbacks=[pruning])
    params = dict(tree_flatten(model.parameters()))
    masked = sorted(pruning.step_state["masks"])
    assert "head.weight" in masked and "layers.0.attention.query_proj.weight" in masked
    assert "layers.0.mlp.layers.0.weight" in masked
    assert not any("embedding" in n or "norm" in n or n.endswith("bias") for n in masked)
    zeros = sum(int((np.array(params[n]) == 0).sum()) for n in masked)
    assert zeros == round(0.8 * sum(params[n].size for n in masked))
    assert _zeros(params["token_embedding.weight"]) == 0.0
    assert pruning.sparsity()["sparsity"] == zeros / sum(params[n].size for n in masked)


def test_parameter_patterns_choose_what_is_pruned(digits):
    mx.random.seed(0)
    model = build_model("mlp", digits["info"], hidden_dims=[32])
    pruning = Pruning(0.5, schedule="one_shot", start_step=2, parameters=["layers.1.*"])
    Trainer(model, optim.SGD(0.1), batch_size=64, max_steps=4, **_quiet()).train(
        digits["train"], epochs=1, callbacks=[pruning])
    assert sorted(pruning.step_state["masks"]) == ["layers.1.bias", "layers.1.weight"]
    assert _zeros(model.layers[0].weight) == 0.0
    layer = model.layers[1]
    zeros = int((np.array(layer.weight) == 0).sum() + (np.array(layer.bias) == 0).sum())
    assert zeros == round(0.5 * (layer.weight.size + layer.bias.size))


def test_end_step_defaults_to_the_runs_length(digits):
    mx.random.seed(0)
    model = build_model("mlp", digits["info"], hidden_dims=[32])
    pruning = Pruning(0.75, start_step=0, frequency=5)
    trainer = Trainer(model, optim.Adam(1e-3), batch_size=64, max_steps=23, **_quiet())
    trainer.train(digits["train"], epochs=5, callbacks=[pruning])
    assert pruning.end_step == 23 and pruning.last_update == 23
    assert pruning.sparsity()["sparsity"] == pytest.approx(0.75, abs=1e-4)


# -- errors -------------------------------------------------------------------------------


def test_bad_arguments_are_clear_errors(digits):
    with pytest.raises(ConfigError, match=r"Pruning sparsity must be in \[0, 1\), got 1.5"):
        Pruning(1.5)
    with pytest.raises(ConfigError, match="Pruning schedule must be one of polynomial, one_shot, got 'cubic'"):
        Pruning(0.5, schedule="cubic")
    with pytest.raises(ConfigError, match="zero_moments must be 'update' .* got 'never'"):
        Pruning(0.5, zero_moments="never")
    with pytest.raises(ConfigError, match="scope must be 'global'"):
        Pruning(0.5, scope="model")
    with pytest.raises(ConfigError, match="end_step \\(10\\) must come after start_step \\(10\\).*one_shot"):
        Pruning(0.5, start_step=10, end_step=10)
    model = build_model("mlp", digits["info"], hidden_dims=[8])
    trainer = Trainer(model, optim.SGD(0.1), batch_size=64, max_steps=2, **_quiet())
    with pytest.raises(ConfigError, match="pattern 'encoder.\\*' matches no trainable parameter of MLP; "
                                          "names look like: layers.0.bias"):
        trainer.train(digits["train"], epochs=1, callbacks=[Pruning(0.5, parameters=["encoder.*"])])
    stream = ((x, y) for x, y in zip(np.zeros((4, 8, 64), np.float32), np.zeros((4, 8), np.int32), strict=True))
    with pytest.raises(ConfigError, match="needs an end_step \\(or a run of known length"):
        Trainer(model, optim.SGD(0.1), batch_size=8, **_quiet()).train(
            stream, epochs=1, callbacks=[Pruning(0.5, start_step=2)])


# -- exact resume -------------------------------------------------------------------------


def _run(run_dir, out, *extra):
    subprocess.run([sys.executable, SCRIPT, str(run_dir), str(out), *extra], check=True,
                   stdout=subprocess.DEVNULL, timeout=300)
    return mx.load(str(out)), mx.load(f"{out}.ema.safetensors"), json.load(open(f"{out}.json"))


def _saved_steps(checkpoint_dir):
    if not os.path.isdir(checkpoint_dir):
        return []
    return sorted(int(n.split("-")[1]) for n in os.listdir(checkpoint_dir)
                  if n.startswith("step-") and ".tmp" not in n
                  and os.path.exists(os.path.join(checkpoint_dir, n, "manifest.json")))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    return _run(d / "run", d / "final.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("kill_after_step", [60, 130])
def test_sigkill_mid_schedule_then_resume_is_bit_exact(tmp_path, uninterrupted, kill_after_step):
    full_params, full_extra, full_info = uninterrupted
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, SCRIPT, str(run_dir), str(tmp_path / "unused"),
                             "--hold-after-save", str(kill_after_step)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 600  # only ends a hung child: the run waits at the checkpoint to be killed
    while proc.poll() is None and not (run_dir / "held").exists():
        assert time.monotonic() < deadline, "the run never reached the checkpoint to kill it at"
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(_saved_steps(run_dir / "checkpoints"))
    assert killed_at == kill_after_step, "the run was not held at the checkpoint it was to be killed after"
    assert killed_at < 200, "killed after the pruning schedule ended: not a mid-schedule resume"

    params, extra, info = _run(run_dir, tmp_path / "resumed.safetensors", "--resume")

    assert info["step"] == full_info["step"]
    assert info["history"] == full_info["history"]
    assert info["sparsity"] == full_info["sparsity"]
    for saved, full in ((params, full_params), (extra, full_extra)):
        assert sorted(saved) == sorted(full)
        for name, value in full.items():
            assert np.array_equal(np.array(saved[name]), np.array(value)), f"{name} differs after resume"
    assert _zeros(params["layers.0.weight"]) > 0.75


@pytest.mark.slow
def test_yaml_pruning_and_ema_settings_reach_the_training(tmp_path):
    from mlx_train.checkpointing import load_checkpoint
    from mlx_train.cli.main import main
    from mlx_train.training.ema import checkpoint_ema_weights

    config = tmp_path / "prune.yaml"
    config.write_text("training:\n  max_steps: 8\n  ema_decay: 0.9\n  prune_sparsity: 0.6\n  prune_start: 2\n"
                      "  prune_end: 6\n  prune_frequency: 2\n  prune_scope: layer\n")
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(config), "--run-dir", str(run_dir)]) == 0
    path = str(max((run_dir / "checkpoints").glob("step-*")))
    arrays, _ = load_checkpoint(path, groups=["model"])
    weights = {k.removeprefix("model."): np.array(v) for k, v in arrays["model"].items()}
    pruned = [k for k in weights if k.endswith(".weight") and weights[k].ndim == 2]
    assert pruned
    averaged = checkpoint_ema_weights(path)
    for name in pruned:
        assert (weights[name] == 0).mean() == pytest.approx(0.6, abs=0.01), name
        assert np.array_equal(np.array(averaged[name]) == 0, weights[name] == 0), name  # masked like the weights

"""GRPO runs as a whole: what cannot change on resume is refused (and what may, may), the out-of-memory split
trains the same completions to the same adapters, and the adapters' files say what was trained with which
rewards."""

from __future__ import annotations

import json
import os
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

from test_llm_grpo import REWARDS, write_setup  # noqa: E402

from mlx_train.cli.main import main  # noqa: E402
from mlx_train.llm import FineTuneConfig, finetune  # noqa: E402
from mlx_train.testing import SimulatedOutOfMemory  # noqa: E402
from mlx_train.training import Callback  # noqa: E402
from mlx_train.training.step import StepObserver  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return write_setup(tmp_path_factory.mktemp("grpo_runs"))


def _grpo(setup, run, *extra):
    return ["finetune", "--model", str(setup / "base"), "--data", str(setup / "data"), "--train-mode", "grpo",
            "--num-layers", "2", "--batch-size", "2", "--group-size", "3", "--max-completion-length", "8",
            "--max-seq-length", "128", "--learning-rate", "5e-3", "--beta", "0.05", "--reward-functions", REWARDS,
            "--save-every", "1", "--steps-per-report", "1", "--val-batches", "1", "--run-dir", str(run), *extra]


def _snapshot(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_grpo_settings_cannot_change_on_resume_but_max_steps_can(setup, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_grpo(setup, run, "--iters", "2")) == 0
    before = _snapshot(run)
    capsys.readouterr()
    for flags, name in [(["--group-size", "4"], "group_size"), (["--temperature", "1.0"], "temperature"),
                        (["--max-completion-length", "6"], "max_completion_length"), (["--beta", "0.0"], "beta"),
                        (["--grpo-loss-type", "bnpo"], "grpo_loss_type"), (["--clip-epsilon", "0.2"], "clip_epsilon"),
                        (["--reward-weights", "1.0,2.0"], "reward_weights"),
                        (["--reward-functions", "grpo_rewards:letter_share"], "reward_functions")]:
        assert main(["finetune", "--run-dir", str(run), "--resume", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert f"{name} cannot change on resume (the run has {name}=" in err and flags[0] in err, err
        assert "start a new run" in err and "Traceback" not in err
        assert _snapshot(run) == before  # a refused command changes nothing
    assert main(["finetune", "--run-dir", str(run), "--resume", "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "max_steps 2 -> 3 (--max-steps 3)" in out and "finetune grpo: 3 steps" in out


class _Rollouts(Callback, StepObserver):
    """Records every micro-batch the steps run (the rollout rows a step trains on), by step."""

    def __init__(self):
        self.seen = {}
        self._trainer = None

    def on_fit_start(self, trainer):
        self._trainer = trainer
        trainer.memory_guard.observe(self)

    def before_micro_batch(self, step, batch, update, weighted):
        self.seen.setdefault(self._trainer.step + 1, []).append({k: np.array(v) for k, v in batch.items()})

    def after_micro_batch(self, step, batch, result, update, weighted):
        """Nothing: the batch was recorded before."""

    def trained(self, step, rows):
        """The rows of the step's last attempt (a failed attempt's micro-batches come first), one array a key."""
        parts = self.seen[step]
        return {k: np.concatenate([p[k] for p in parts])[-rows:] for k in parts[0]}


def _grpo_run(setup, run, callbacks):
    config = FineTuneConfig(model=str(setup / "base"), data=str(setup / "data"), train_mode="grpo", iters=3,
                            batch_size=2, group_size=3, max_completion_length=8, max_seq_length=128, num_layers=2,
                            learning_rate=1e-3, beta=0.05, reward_functions=REWARDS, steps_per_report=1,
                            steps_per_eval=100, run_dir=str(run))
    result = finetune(config, callbacks=callbacks, log=lambda line: None)
    reports = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return dict(tree_flatten(result["model"].trainable_parameters())), result["trainer"], \
        [r for r in reports if r["kind"] == "train"]


@pytest.mark.slow
def test_an_out_of_memory_step_trains_the_same_completions_to_the_same_adapters(setup, tmp_path):
    """Step 2 runs out of memory after its update was dispatched: it is undone and redone as two micro-batches of
    the same rollout (not sampled again), and the run (3 steps) ends with the unsplit run's adapters to float
    rounding. (At a learning rate that makes this tiny model's steps chaotic, e.g. adam at 5e-3 or sgd at 0.5,
    the rounding differences of step 2 grow to 1-2% by step 3 in both directions: a property of the
    optimisation, not of the split, whose gradients agree to 1e-6.)"""
    recorded, plain = _Rollouts(), _Rollouts()
    simulated = SimulatedOutOfMemory(steps=[2])
    split, trainer, split_reports = _grpo_run(setup, tmp_path / "split", [simulated, recorded])
    whole, _, whole_reports = _grpo_run(setup, tmp_path / "whole", [plain])
    assert simulated.failures == [2] and trainer.memory_guard.events[0]["step"] == 2
    assert [len(recorded.seen[s]) for s in (1, 2, 3)] == [1, 3, 2]  # one failed attempt, then halves
    assert [len(plain.seen[s]) for s in (1, 2, 3)] == [1, 1, 1]
    for step in (1, 2, 3):
        mine, theirs = recorded.trained(step, 6), plain.trained(step, 6)
        for key in ("inputs", "targets", "positions", "advantages", "rewards", "function_rewards"):
            assert np.array_equal(mine[key], theirs[key], equal_nan=True), (step, key)  # the same completions
    assert [r["reward_mean"] for r in split_reports] == pytest.approx([r["reward_mean"] for r in whole_reports],
                                                                      rel=1e-6)
    assert split.keys() == whole.keys()
    worst = max(float(mx.abs(split[k] - whole[k]).max() / mx.abs(whole[k]).max()) for k in whole)
    assert worst < 1e-5, worst
    assert all(float(mx.abs(v).max()) > 0 for k, v in whole.items() if k.endswith("lora_b"))  # it trained

"""GRPO runs as a whole: what cannot change on resume is refused (and what may, may), the out-of-memory split
trains the same completions to the same adapters, and the adapters' files say what was trained with which
rewards."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

from test_llm_grpo import REWARDS, write_setup  # noqa: E402

from mlx_train.cli.main import main  # noqa: E402


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

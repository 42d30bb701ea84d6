"""The command line around a resume and the messages of the bug report: a resumed run keeps its saved
configuration, applies only the changes a resume can take, and fails cleanly (one line, no traceback)."""

import json
import shutil

import pytest

from mlx_train.cli import train as train_command
from mlx_train.cli.main import build_parser, main
from mlx_train.cli.train import build_config
from mlx_train.config import TrainConfig
from mlx_train.errors import TrainingInterrupted

TINY = ["--set", "model_options.hidden_dims=[16]", "--set", "report_every=1", "--set", "checkpoint_every=2"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 4-step MLP run (seed 42) with a checkpoint every 2 steps and a metrics row every step."""
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    assert main(["train", "--max-steps", "4", "--seed", "42", *TINY, "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.fixture
def run_copy(tiny_run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy)
    capsys.readouterr()
    return copy


def _clean(captured):
    """The error output, checked to hold no traceback."""
    assert "Traceback" not in captured.err + captured.out
    return captured.err


def test_resume_takes_the_saved_configuration_of_a_cnn_run(tmp_path, capsys):
    run_dir = tmp_path / "cnn"
    assert main(["train", "--model", "cnn", "--seed", "42", "--max-steps", "2", "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    # The command printed after Ctrl-C, plus a longer run: the model, seed and dataset come from config.yaml.
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step-00000002" in out
    assert "changed: max_steps 2 -> 3 (--max-steps 3)" in out
    saved = TrainConfig.from_yaml(run_dir / "config.yaml")
    assert (saved.model, saved.seed, saved.max_steps) == ("cnn", 42, 3)


@pytest.mark.parametrize("flags, field, why", [
    (["--seed", "0"], "seed", "random state come from the checkpoint"),
    (["--model", "cnn"], "model", "holds the weights of that model"),
    (["--dataset", "text"], "dataset", "data order"),
    (["--batch-size", "8"], "batch_size", "unless the global batch stays 32"),
    (["--set", "optimizer=sgd"], "optimizer", "that optimizer's state"),
    (["--set", "model_options.hidden_dims=[8]"], "model_options", "weights of that shape"),
])
def test_resume_refuses_what_cannot_change_and_leaves_config_yaml(run_copy, capsys, flags, field, why):
    before = (run_copy / "config.yaml").read_bytes()
    assert main(["train", "--run-dir", str(run_copy), "--resume", *flags]) == 2
    err = _clean(capsys.readouterr())
    assert f"{field} cannot change on resume" in err and why in err
    assert "start a new run: a new --run-dir, without --resume" in err
    assert (run_copy / "config.yaml").read_bytes() == before


def test_resume_applies_a_new_constant_learning_rate_and_says_so(run_copy, capsys):
    assert main(["train", "--run-dir", str(run_copy), "--resume", "--lr", "0.5", "--max-steps", "6"]) == 0
    assert "learning_rate 0.001 -> 0.5 (--lr 0.5)" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    rates = {row["step"]: row["learning_rate"] for row in rows if row.get("kind") == "train"}
    assert rates[4] == pytest.approx(1e-3) and rates[5] == pytest.approx(0.5) and rates[6] == pytest.approx(0.5)
    assert TrainConfig.from_yaml(run_copy / "config.yaml").learning_rate == 0.5


def test_resume_refuses_a_new_learning_rate_under_a_schedule(tmp_path, capsys):
    run_dir = tmp_path / "sched"
    assert main(["train", "--max-steps", "2", "--set", "warmup_steps=2", "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--lr", "0.5"]) == 2
    assert "learning_rate cannot change on resume" in _clean(capsys.readouterr())


def test_resume_with_every_checkpoint_damaged_is_one_line_exit_4(run_copy, capsys):
    before = (run_copy / "config.yaml").read_bytes()
    for step in (run_copy / "checkpoints").glob("step-*"):
        (step / "model.safetensors").write_bytes(b"garbage")
    assert main(["train", "--run-dir", str(run_copy), "--resume", "--max-steps", "8"]) == 4
    err = _clean(capsys.readouterr())
    errors = [line for line in err.splitlines() if line.startswith("mlx-train: error:")]
    assert len(errors) == 1 and "is incomplete or damaged" in errors[0]
    assert (run_copy / "config.yaml").read_bytes() == before  # rewritten only after a successful restore


@pytest.mark.parametrize("signum, code", [(15, 143), (2, 130)])
def test_interrupted_training_prints_the_resume_command(monkeypatch, tmp_path, capsys, signum, code):
    def stopped(config, resume=None, log=print):
        raise TrainingInterrupted(signum, 7, f"{config.run_dir}/checkpoints/step-00000007", "training stopped")

    monkeypatch.setattr(train_command, "run", stopped)
    assert main(["train", "--run-dir", str(tmp_path / "r")]) == code
    err = _clean(capsys.readouterr())
    assert f"to continue: mlx-train train --run-dir {tmp_path / 'r'} --resume" in err


@pytest.mark.parametrize("flags, expected", [
    (["-n", "4"], "-n 4 only applies to a distributed run: add --distributed"),
    (["--hostfile", "hosts.json"], "--hostfile hosts.json only applies to a distributed run: add --distributed"),
])
def test_distributed_flags_without_distributed_are_an_error(tmp_path, capsys, flags, expected):
    assert main(["train", *flags, "--run-dir", str(tmp_path / "r")]) == 2
    assert expected in _clean(capsys.readouterr())
    assert not (tmp_path / "r").exists()


def test_set_values_are_applied_together():
    args = build_parser().parse_args(["train", "--set", "momentum=0.9", "--set", "optimizer=sgd"])
    config = build_config(args)
    assert (config.optimizer, config.momentum) == ("sgd", 0.9)


def test_learning_rate_is_an_alias_of_lr(capsys):
    assert build_config(build_parser().parse_args(["train", "--learning-rate", "0.1"])).learning_rate == 0.1
    assert main(["train", "--learning_rate", "0.1"]) == 2
    assert "(did you mean '--learning-rate'?)" in capsys.readouterr().err
    assert main(["train", "--weight-decay", "0.1"]) == 2
    assert "did you mean '--set weight_decay=VALUE'?" in capsys.readouterr().err


@pytest.mark.parametrize("place", ["file", "under-a-file"])
def test_run_dir_that_cannot_be_a_directory(tmp_path, capsys, place):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    run_dir = blocker if place == "file" else blocker / "run"
    assert main(["train", "--max-steps", "1", "--run-dir", str(run_dir)]) == 2
    err = _clean(capsys.readouterr())
    assert "unexpected error" not in err
    assert ("is a file, not a directory" if place == "file" else "cannot create the run directory") in err
    assert "pass --run-dir a directory that can be written" in err


def test_read_only_run_dir_is_one_line(tmp_path, capsys, monkeypatch):
    # Root may write anywhere, so the permission check itself is what is made to say no.
    monkeypatch.setattr(train_command.os, "access", lambda path, mode: False)
    assert main(["train", "--max-steps", "1", "--run-dir", str(tmp_path / "r")]) == 2
    err = _clean(capsys.readouterr())
    assert f"the run directory {tmp_path / 'r'} is not writable; pass --run-dir a directory" in err


def test_plot_names_the_unknown_metric_and_lists_the_known(tiny_run, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plot", str(tiny_run), "--metrics", "los,val_los", "-o", str(tiny_run / "x.png")]) == 2
    err = _clean(capsys.readouterr())
    assert "unknown metrics los, val_los (did you mean 'loss'?)" in err and "has learning_rate, loss" in err


def test_evaluate_a_damaged_checkpoint_suggests_checkpoint_not_resume(run_copy, capsys):
    newest = run_copy / "checkpoints" / "step-00000004"
    (newest / "model.safetensors").unlink()
    assert main(["evaluate", "--checkpoint", str(newest)]) == 4
    err = _clean(capsys.readouterr())
    assert "--resume" not in err and "evaluate that one with --checkpoint" in err and "step-00000002" in err


def test_half_precision_on_the_linux_cpu_warns_at_start(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train_command.sys, "platform", "linux")
    with pytest.warns(UserWarning, match="precision bfloat16 on the Linux CPU is much slower than float32"):
        assert main(["train", "--precision", "bfloat16", "--max-steps", "1",
                     "--set", "model_options.hidden_dims=[8]", "--run-dir", str(tmp_path / "r")]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(15, 143), (2, 130)])
def test_a_signal_mid_run_saves_prints_the_command_and_that_command_resumes(tmp_path, signum, code):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import mlx_train

    src = str(Path(mlx_train.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run_dir = tmp_path / "cnn"
    argv = [sys.executable, "-m", "mlx_train", "train", "--model", "cnn", "--seed", "42", "--max-steps", "100000",
            "--set", "report_every=1", "--set", "num_workers=0", "--run-dir", str(run_dir)]
    with subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        for line in process.stdout:
            if line.startswith("step 2 "):  # training is under way: the signal handler is installed
                process.send_signal(signum)
                break
        out, err = process.communicate(timeout=120)
    assert process.returncode == code, err
    command = f"mlx-train train --run-dir {run_dir} --resume"
    assert f"to continue: {command}" in err and "Traceback" not in err + out
    again = subprocess.run([sys.executable, "-m", "mlx_train", *command.split()[1:], "--max-steps", "40"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "changed: max_steps 100000 -> 40" in again.stdout
    saved = TrainConfig.from_yaml(run_dir / "config.yaml")
    assert (saved.model, saved.seed, saved.max_steps) == ("cnn", 42, 40)

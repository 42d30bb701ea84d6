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
        (tmp_path / "r" / "checkpoints" / "step-00000007").mkdir(parents=True)
        raise TrainingInterrupted(signum, 7, f"{config.run_dir}/checkpoints/step-00000007", "training stopped")

    monkeypatch.setattr(train_command, "run", stopped)
    assert main(["train", "--run-dir", str(tmp_path / "r")]) == code
    err = _clean(capsys.readouterr())
    assert f"to continue: mlx-train train --run-dir {tmp_path / 'r'} --resume" in err


def test_interrupted_before_anything_was_saved_prints_no_resume_command(monkeypatch, tmp_path, capsys):
    def stopped(config, resume=None, log=print):
        raise KeyboardInterrupt  # Ctrl-C during start-up: no checkpoint, no config.yaml yet

    monkeypatch.setattr(train_command, "run", stopped)
    assert main(["train", "--run-dir", str(tmp_path / "r")]) == 130
    err = _clean(capsys.readouterr())
    assert "--resume" not in err and "nothing of this run was saved yet" in err


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


def _snapshot(directory):
    """Every file under ``directory`` with its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_command_refused_by_the_lock_changes_nothing(run_copy, capsys):
    import os
    import socket
    import subprocess

    from mlx_train import processes

    holder = subprocess.Popen(["sleep", "60"])  # stands for the run that holds the directory
    try:
        lock = {"host": socket.gethostname(), "pid": holder.pid, "started": 0.0,
                "process_started": processes.start_time(holder.pid)}
        (run_copy / ".mlx-train.lock").write_text(json.dumps(lock))
        before = _snapshot(run_copy)
        argv = ["train", "--run-dir", str(run_copy), "--lr", "0.5", "--seed", "3", "--epochs", "7"]
        for extra in ([], ["--overwrite"]):
            assert main([*argv, *extra]) == 4
            assert f"is in use by another run: pid {holder.pid}" in _clean(capsys.readouterr())
            assert _snapshot(run_copy) == before and sorted(os.listdir(run_copy.parent)) == ["run"]
    finally:
        holder.kill()
        holder.wait()


def test_a_new_run_into_a_finished_run_is_refused_and_changes_nothing(run_copy, capsys):
    before = _snapshot(run_copy)
    assert main(["train", "--run-dir", str(run_copy), "--max-steps", "2", "--lr", "0.5"]) == 2
    err = _clean(capsys.readouterr())
    assert f"{run_copy} already holds a run (metrics.jsonl, config.yaml, checkpoints)" in err
    assert "To continue it: --resume" in err and "--overwrite" in err
    assert _snapshot(run_copy) == before


def test_overwrite_moves_the_old_run_aside_whole(run_copy, capsys):
    before = _snapshot(run_copy)
    assert main(["train", "--run-dir", str(run_copy), "--max-steps", "2", "--seed", "3", *TINY, "--overwrite"]) == 0
    out = capsys.readouterr().out
    (moved,) = run_copy.parent.glob("run.old-*")
    assert f"moved the previous run in {run_copy} aside to {moved}" in out
    assert _snapshot(moved) == {k: v for k, v in before.items() if k != ".mlx-train.lock"}
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ["step-00000002"]  # one run's checkpoints
    rows = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert max(row["step"] for row in rows) == 2
    assert TrainConfig.from_yaml(run_copy / "config.yaml").seed == 3


@pytest.mark.parametrize("damage", ["empty", "missing"])
def test_resume_follows_the_checkpoint_not_a_damaged_config_yaml(tmp_path, capsys, damage):
    run_dir = tmp_path / "run"
    assert main(["train", "--lr", "0.01", "--epochs", "3", "--seed", "5", "--max-steps", "2", *TINY,
                 "--run-dir", str(run_dir)]) == 0
    config_path = run_dir / "config.yaml"
    config_path.write_text("") if damage == "empty" else config_path.unlink()  # as a kill mid-write left it
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--max-steps", "4"]) == 0
    out = capsys.readouterr().out
    assert f"with the configuration of {run_dir / 'checkpoints' / 'step-00000002'}" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {row["step"]: row["learning_rate"] for row in rows if row["kind"] == "train"} == \
        pytest.approx({1: 0.01, 2: 0.01, 3: 0.01, 4: 0.01})
    saved = TrainConfig.from_yaml(config_path)
    assert (saved.learning_rate, saved.epochs, saved.seed, saved.max_steps) == (0.01, 3, 5, 4)
    assert saved.model_options == {"hidden_dims": [16]}


def test_config_yaml_is_written_once_atomically_under_the_lock(run_copy, monkeypatch, capsys):
    from mlx_train import rundir
    from mlx_train.checkpointing import lock

    writes, real_write = [], rundir.atomic_write

    def atomic_write(path, data, durable=True):
        if str(path).endswith("config.yaml"):
            writes.append((lock.LOCK_FILE in {p.name for p in run_copy.iterdir()}, TrainConfig.from_yaml(run_copy
                          / "config.yaml").max_steps))
        return real_write(path, data, durable)

    monkeypatch.setattr(rundir, "atomic_write", atomic_write)
    assert main(["train", "--run-dir", str(run_copy), "--resume", "--max-steps", "6"]) == 0
    assert writes == [(True, 4)]  # one write, while the lock was held, over the old complete file
    assert TrainConfig.from_yaml(run_copy / "config.yaml").max_steps == 6


def test_resume_with_nothing_to_resume_is_an_error_not_a_new_run(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "none"), "--resume", "--max-steps", "1"]) == 4
    err = _clean(capsys.readouterr())
    assert f"there is nothing to resume in {tmp_path / 'none'}" in err
    assert not (tmp_path / "none").exists()


def test_a_config_yaml_that_cannot_be_written_is_one_line(tmp_path, capsys):
    (tmp_path / "r" / "config.yaml").mkdir(parents=True)  # in the way of the file
    assert main(["train", "--run-dir", str(tmp_path / "r"), "--max-steps", "1", *TINY]) == 2
    err = _clean(capsys.readouterr())
    assert f"cannot write {tmp_path / 'r' / 'config.yaml'}: Is a directory; make room for that file" in err


def test_a_supervised_restart_before_anything_was_saved_starts_from_its_config(tmp_path, monkeypatch):
    from mlx_train.distributed.rank import ENV_STATE_DIR

    monkeypatch.setenv(ENV_STATE_DIR, str(tmp_path / "r" / "distributed"))  # the supervisor's --resume auto
    args = build_parser("train").parse_args(["train", "--run-dir", str(tmp_path / "r"), "--resume", "auto",
                                             "--seed", "7"])
    config = train_command.resolve_config(args)
    assert (config.seed, config.run_dir) == (7, str(tmp_path / "r"))

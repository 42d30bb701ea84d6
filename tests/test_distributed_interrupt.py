"""Stopping a distributed run on request, and resuming it on another number of processes, with real
processes launched by ``mlx-train train --distributed`` on 127.0.0.1 (ring backend)."""

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_train import processes, rundir
from mlx_train.cli.main import main
from mlx_train.errors import TrainingInterrupted
from mlx_train.launch.supervisor import RecoveryPolicy, supervise

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = str(Path(__file__).parent / "scripts" / "ranked_run.py")
TRAIN = ["--epochs", "4", "--set", "num_workers=0"]  # the built-in MLP on digits: 19 steps per epoch of 64


@pytest.fixture(autouse=True)
def environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # two ranks on two cores


def _final_model(run_dir: Path) -> dict:
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return {k: np.array(v) for k, v in mx.load(str(newest / "model.safetensors")).items()}


def _beats(run_dir: Path) -> dict:
    beats = {}
    for rank in (0, 1):
        path = rundir.heartbeat_path(run_dir, rank)
        try:
            beats[rank] = json.loads(path.read_text())
        except (OSError, ValueError):  # not written yet, or being replaced
            pass
    return beats


def _interrupt_after(run_dir: Path, step: int, signum: int, *flags: str) -> subprocess.CompletedProcess:
    """Start a 2-rank run, send ``signum`` to the supervisor once both ranks passed ``step``, wait for it."""
    argv = [sys.executable, "-m", "mlx_train", "train", "--distributed", "-n", "2", "--run-dir", str(run_dir), *flags]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        beats = _beats(run_dir)
        if len(beats) == 2 and min(beat.get("step", 0) for beat in beats.values()) >= step:
            break
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before it could be interrupted"
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def test_sigterm_to_the_supervisor_saves_at_one_step_and_the_resumed_run_ends_bit_exact(tmp_path):
    reference, run_dir = tmp_path / "reference", tmp_path / "interrupted"
    assert main(["train", "--distributed", "-n", "2", "--run-dir", str(reference), *TRAIN]) == 0

    stopped = _interrupt_after(run_dir, 5, signal.SIGTERM, *TRAIN)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert "SIGTERM received: forwarded to rank" in stopped.stderr
    beats = _beats(run_dir)
    assert beats[0]["state"] == beats[1]["state"] == "interrupted", beats
    step = beats[0]["step"]
    assert beats[1]["step"] == step and 5 <= step < 4 * 19  # every rank stopped at the same step
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert newest.name == f"step-{step:08d}"  # saved there: no step lost
    assert f"the newest checkpoint is {newest} (step {step})" in stopped.stderr
    again = stopped.stderr.strip().splitlines()[-1]
    assert again == f"to continue: mlx-train train --distributed -n 2 --run-dir {run_dir} --resume"
    # the ranks leave the command to the supervisor: theirs would lack --distributed
    assert stopped.stderr.count("to continue:") == 1, stopped.stderr

    assert main(shlex.split(again.removeprefix("to continue: mlx-train "))) == 0
    assert f"resumed from {newest} (step {step}" in (run_dir / "logs" / "rank-0.log").read_text()
    a, b = _final_model(reference), _final_model(run_dir)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)  # bit for bit


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_ranks_that_do_not_stop_in_time_are_killed(tmp_path, signum):
    """A rank kept busy (a long callback) cannot finish its step: after interrupt_timeout the
    supervisor kills the group and still reports the interruption."""
    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    command = [sys.executable, SCRIPT, str(run_dir), "--checkpoint-dir", str(run_dir / "ckpt"),
               "--busy-rank", "1", "--busy-step", "3", "--busy-seconds", "60"]

    def interrupt_when_busy():
        while _beats(run_dir).get(1, {}).get("step", 0) < 3:
            time.sleep(0.05)
        os.kill(os.getpid(), signum)  # the supervisor's handler runs in this (main) thread

    threading.Thread(target=interrupt_when_busy, daemon=True).start()
    policy = RecoveryPolicy(max_restarts=0, interrupt_timeout=2.0)
    with open(run_dir / "output.txt", "w") as out, pytest.raises(TrainingInterrupted) as stopped:
        supervise(command, num_processes=2, run_dir=run_dir, checkpoint_dir=str(run_dir / "ckpt"), policy=policy,
                  output=(out, out))
    assert stopped.value.code == 128 + signum
    log = (run_dir / "distributed" / "supervisor.log").read_text()
    assert f"the ranks did not stop within 2 s of the {signum.name}: killing them" in log
    assert not any(processes.alive(beat["pid"]) for beat in _beats(run_dir).values())


def test_a_two_rank_run_resumed_on_one_process_and_back_keeps_its_global_batch(tmp_path, capsys):
    reference, run_dir = tmp_path / "reference", tmp_path / "moved"
    two, one = ["train", "--distributed", "-n", "2", "--set", "num_workers=0"], ["train", "--set", "num_workers=0"]
    assert main([*two, "--run-dir", str(reference), "--max-steps", "40"]) == 0
    assert main([*two, "--run-dir", str(run_dir), "--max-steps", "10"]) == 0
    capsys.readouterr()
    saved_config = (run_dir / "config.yaml").read_bytes()
    # batch 16 on one process would make a global batch of 16: refused, with the settings that keep 64
    assert main([*one, "--run-dir", str(run_dir), "--resume", "--batch-size", "16"]) == 2
    assert (run_dir / "config.yaml").read_bytes() == saved_config
    err = capsys.readouterr().err
    assert "batch_size cannot change on resume unless the global batch stays 64" in err, err
    assert "with --set gradient_accumulation=4 (with batch_size 16); or --batch-size 64 (with " in err
    # the same flags on one process: the accumulation doubles, so the global batch stays 64
    assert main([*one, "--run-dir", str(run_dir), "--resume", "--max-steps", "25"]) == 0
    out = capsys.readouterr().out
    assert "gradient_accumulation 1 -> 2 to keep the global batch of 64" in out, out
    assert main([*two, "--run-dir", str(run_dir), "--resume", "--max-steps", "40"]) == 0
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000025'} (step 25" in log
    a, b = _final_model(reference), _final_model(run_dir)
    for name in a:  # 2 x batch 32 vs 1 x batch 32 x accumulation 2: equal up to float rounding
        assert np.abs(a[name] - b[name]).max() / np.abs(a[name]).max() < 1e-5, name

"""A supervisor killed with SIGKILL: its ranks stop on their own (at one step, with a checkpoint), and until
they are gone a resume of the run says which process holds it. Real processes started by
``mlx-train train --distributed`` on 127.0.0.1 (ring backend; one rank: the rank is the supervisor's child)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_train import processes, rundir
from mlx_train.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(autouse=True)
def environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # two ranks on two cores


def _beats(run_dir: Path, ranks: int) -> dict:
    beats = {}
    for rank in range(ranks):
        try:
            beats[rank] = json.loads(rundir.heartbeat_path(run_dir, rank).read_text())
        except (OSError, ValueError):  # not written yet, or being replaced
            pass
    return beats


def _wait(condition, what: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _log(run_dir: Path, rank: int) -> str:
    path = rundir.rank_log_path(run_dir, rank)
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("ranks", [1, 2])
def test_ranks_of_a_killed_supervisor_stop_and_save_and_hold_the_run_until_they_exit(tmp_path, capsys, ranks):
    run_dir, go = tmp_path / "run", tmp_path / "go"
    # The stop's checkpoint, once complete, waits for the go file: the ranks hold the run meanwhile.
    hold = {"MLX_TRAIN_SAVE_PAUSE_AFTER": "commit", "MLX_TRAIN_SAVE_PAUSE_UNTIL": str(go),
            "MLX_TRAIN_SAVE_PAUSE_SECONDS": "600"}
    argv = [sys.executable, "-m", "mlx_train", "train", "--distributed", "-n", str(ranks), "--run-dir", str(run_dir),
            "--epochs", "1000", "--set", "num_workers=0", "--set", "checkpoint_every=100000 steps"]
    supervisor = subprocess.Popen(argv, env={**os.environ, **hold}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        beats = _wait(lambda: (b := _beats(run_dir, ranks)) and len(b) == ranks
                      and min(beat.get("step", 0) for beat in b.values()) >= 3 and b, "the ranks to train")
        pids = {rank: beat["pid"] for rank, beat in beats.items()}
    finally:
        supervisor.kill()
        supervisor.communicate()
    try:
        _wait(lambda: "save paused after commit" in _log(run_dir, 0), "the ranks to stop and save")
        for rank in range(ranks):
            notice = f"the supervisor (pid {supervisor.pid}) is gone: rank {rank} stops after its current step and " \
                     "saves a checkpoint"
            _wait(lambda r=rank, line=notice: line in _log(run_dir, r), f"rank {rank} to notice")
        assert all(processes.alive(pid) for pid in pids.values())

        capsys.readouterr()
        assert main(["train", "--distributed", "-n", str(ranks), "--run-dir", str(run_dir), "--resume"]) == 4
        err = capsys.readouterr().err
        held = re.search(rf"run directory {re.escape(str(run_dir))} is held by another process: pid (\d+), rank (\d) "
                         r"of a distributed run on it \(its supervisor is gone, so it finishes its current step, saves "
                         r"a checkpoint and exits\)\. Resume once it has exited", err)
        assert held and pids[int(held[2])] == int(held[1]), err
        assert "lost its connection" not in err
    finally:
        go.touch()
    _wait(lambda: not any(processes.alive(pid) for pid in pids.values()), "the ranks to exit")

    beats = _beats(run_dir, ranks)
    assert {beat["state"] for beat in beats.values()} == {"interrupted"}, beats
    step = beats[0]["step"]
    assert {beat["step"] for beat in beats.values()} == {step} and step >= 3  # stopped at one step
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert newest.name == f"step-{step:08d}"  # saved there
    assert main(["train", "--distributed", "-n", str(ranks), "--run-dir", str(run_dir), "--resume",
                 "--max-steps", str(step + 2)]) == 0
    assert f"resumed from {newest} (step {step}" in _log(run_dir, 0)

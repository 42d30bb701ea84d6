"""Faults the supervisor must catch by itself, with real processes launched by mlx.launch on 127.0.0.1:
a frozen (SIGSTOPped) rank found by its heartbeat, a host ssh cannot reach, and -n against a
configured cluster."""

import json
import re
import shutil
import socket
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_train import processes, rundir
from mlx_train.cli.main import main
from mlx_train.errors import ConfigError, DistributedError
from mlx_train.launch.supervisor import RecoveryPolicy, supervise
from mlx_train.launch.train import cluster_for

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = str(Path(__file__).parent / "scripts" / "ranked_run.py")


@pytest.fixture(autouse=True)
def environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # two ranks on two cores


def _run(run_dir: Path, *args: str, policy: RecoveryPolicy, hostfile=None, timeout: float = 60.0):
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = str(run_dir / "ckpt")
    command = [sys.executable, SCRIPT, str(run_dir), "--checkpoint-dir", checkpoints, "--timeout", str(timeout), *args]
    with open(run_dir / "output.txt", "w") as out:
        return supervise(command, num_processes=2, hostfile=hostfile, run_dir=run_dir, checkpoint_dir=checkpoints,
                         policy=policy, output=(out, out))


def _load(path: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(path)).items()}


def test_a_frozen_rank_is_caught_by_its_heartbeat_and_the_run_ends_as_if_uninterrupted(tmp_path):
    # collective_timeout 60 s: the peer's watchdog would take a minute; the heartbeat check, 3 s.
    policy = RecoveryPolicy.from_collective_timeout(2, 60.0, frozen_timeout=3.0)
    clean = _run(tmp_path / "clean", policy=policy)
    frozen = _run(tmp_path / "frozen", "--stop-rank", "1", "--stop-step", "10", policy=policy)
    assert clean.restarts == [], [r.cause for r in clean.restarts]
    assert frozen.attempts == 2, [r.cause for r in frozen.restarts]
    (restart,) = frozen.restarts
    found = re.fullmatch(r"rank 1 is frozen: no heartbeat for ([0-9.]+) s \(limit 3 s; its monitor thread writes it "
                         r"every 0\.5 s, .*; pid (\d+) on .*, state running, \d+ steps done\)", restart.cause)
    assert found, restart.cause
    assert 3.0 <= float(found[1]) < 10.0
    assert not processes.alive(int(found[2]))  # the stopped process was killed, not left behind
    assert restart.resume_from == str(tmp_path / "frozen" / "ckpt" / "step-00000008")
    (entry,) = [json.loads(line) for line in (tmp_path / "frozen" / "distributed" / "restarts.jsonl").open()]
    assert entry["cause"] == restart.cause
    a, b = _load(tmp_path / "clean" / "params.safetensors"), _load(tmp_path / "frozen" / "params.safetensors")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)  # bit for bit


def test_a_rank_busy_for_longer_than_the_limit_is_not_taken_for_frozen(tmp_path):
    # Its main thread computes for 8 s (as in a long validation); the monitor thread keeps beating.
    policy = RecoveryPolicy.from_collective_timeout(0, 60.0, frozen_timeout=3.0)
    busy = _run(tmp_path / "busy", "--busy-rank", "1", "--busy-step", "6", "--busy-seconds", "8", "--max-steps", "10",
                policy=policy)
    assert busy.restarts == [] and busy.attempts == 1, [r.cause for r in busy.restarts]
    assert busy.seconds > 8.0


def test_the_heartbeat_timeout_flag_reaches_the_supervisor(monkeypatch, tmp_path):
    from mlx_train.launch import supervisor as supervisor_module

    seen = {}

    def run(self):
        seen["policy"] = self.policy
        return supervisor_module.SupervisedRun(str(self.run_dir))

    monkeypatch.setattr(supervisor_module.Supervisor, "run", run)
    assert main(["train", "--distributed", "-n", "2", "--heartbeat-timeout", "7.5", "--max-steps", "1",
                 "--run-dir", str(tmp_path / "r")]) == 0
    assert seen["policy"].frozen_timeout == 7.5
    with pytest.raises(ConfigError, match="frozen_timeout must be > 0 seconds"):
        RecoveryPolicy(frozen_timeout=0)


def _closed_port() -> int:
    with socket.socket() as s:  # nothing listens on it once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_host_is_reported_with_the_ssh_error_and_not_retried(tmp_path):
    port = _closed_port()
    unreachable = f"ssh://127.0.0.1:{port}"
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                                 {"ssh": unreachable, "ips": ["127.0.0.1"]}]))
    run_dir = tmp_path / "unreachable"
    why = (f"ssh {re.escape(unreachable)} failed: ssh: connect to host 127.0.0.1 port {port}: Connection refused"
           if shutil.which("ssh") else "ssh is not installed on this machine")
    message = f"rank 1 cannot run on {re.escape(unreachable)}: {why}; .*not restarting"
    with pytest.raises(DistributedError, match=message) as raised:
        _run(run_dir, policy=RecoveryPolicy(max_restarts=3), hostfile=str(hosts))
    assert "exited with code" not in str(raised.value)
    assert not (run_dir / "distributed" / "restarts.jsonl").exists()  # no retry
    assert not [line for line in (run_dir / "distributed" / "supervisor.log").read_text().splitlines()
                if "restart 1" in line]


def test_a_failed_group_points_only_at_files_that_exist(tmp_path):
    run_dir = tmp_path / "fails"
    command = [sys.executable, "-c", "import sys; sys.exit(1)"]  # no rank log is ever written
    with pytest.raises(DistributedError, match=r"max_restarts \(0\) is used up; last failure: rank \d exited with "
                                               r"code 1\Z"):
        supervise(command, num_processes=2, run_dir=run_dir, policy=RecoveryPolicy(max_restarts=0),
                  output=(open(tmp_path / "out.txt", "w"), open(tmp_path / "err.txt", "w")))
    assert not (run_dir / "logs").exists()


def test_n_and_a_configured_cluster_agree(tmp_path, capsys):
    assert main(["configure", "--distributed", "-n", "2"]) == 0
    assert cluster_for(None, None, "auto").num_processes == 2
    assert cluster_for(2, None, "auto").num_processes == 2
    assert cluster_for(4, None, "auto").num_processes == 4  # a multiple: two ranks per entry
    with pytest.raises(ConfigError, match=r"-n 3 does not match the configured cluster \(.*cluster.*\), which has 2 "
                                          r"entries \(one per rank\): -n is the total number of processes"):
        cluster_for(3, None, "auto")
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    assert cluster_for(2, str(hosts), "auto").num_processes == 2
    with pytest.raises(ConfigError, match=r"-n 5 does not match host file .*hosts.json, which has 2 entries.*edit the "
                                          r"host file"):
        cluster_for(5, str(hosts), "auto")
    capsys.readouterr()
    run_dir = tmp_path / "cli"
    code = main(["train", "--distributed", "-n", "2", "--max-steps", "2", "--epochs", "1", "--run-dir", str(run_dir),
                 "--max-restarts", "0", "--set", "num_workers=0"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "distributed run: 2 processes x batch 32" in out.out
    assert sorted(p.name for p in run_dir.glob("heartbeat-*.json")) == ["heartbeat-0.json", "heartbeat-1.json"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_stopped_from_outside_is_the_one_the_restart_names(tmp_path, rank):
    """SIGTERM to one rank (not to the supervisor): every rank stops at one step and exits 143, and the restart
    names the rank the signal reached, as its heartbeat says, not the first exit mlx.launch reported."""
    import os
    import signal
    import subprocess
    import time

    run_dir = tmp_path / "run"
    env = {**os.environ, "MLX_TRAIN_HOME": str(tmp_path / "home")}
    argv = [sys.executable, "-m", "mlx_train", "train", "--distributed", "-n", "2", "--run-dir", str(run_dir),
            "--epochs", "1000", "--max-restarts", "1", "--set", "num_workers=0"]
    supervisor = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    restarts = run_dir / "distributed" / "restarts.jsonl"
    try:
        deadline = time.monotonic() + 180
        beats: dict = {}
        while time.monotonic() < deadline and not (len(beats) == 2 and min(b.step for b in beats.values()) >= 3):
            time.sleep(0.05)
            beats = rundir.read_heartbeats(run_dir)
        os.kill(beats[rank].pid, signal.SIGTERM)
        while time.monotonic() < deadline and not restarts.exists():
            time.sleep(0.05)
    finally:
        supervisor.send_signal(signal.SIGTERM)  # ends the restarted group (it saves and stops)
        err = supervisor.communicate(timeout=180)[1]
    (entry,) = [json.loads(line) for line in restarts.open()]
    # The SIGTERM reached the supervisor while it restarted the group: whatever it had started stops with it.
    deadline = time.monotonic() + 120
    while (left := _processes_of_run(entry["run_id"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the run left running after the supervisor exited: {left}"
    assert re.fullmatch(rf"rank {rank} got SIGTERM from outside the supervisor, and the other ranks stopped with it "
                        r"after step \d+", entry["cause"]), (entry, err[-3000:])
    assert f"restart 1 of 1: {entry['cause']}; resuming from checkpoint" in err


def _processes_of_run(run_id: str) -> dict[int, str]:
    """``{pid: command line}`` of the live processes started for the supervised run ``run_id``."""
    from mlx_train.distributed.environment import ENV_RUN_ID

    return {pid: processes.cmdline(pid) for pid in processes.pids()
            if processes.environ(pid).get(ENV_RUN_ID) == run_id and processes.alive(pid)}

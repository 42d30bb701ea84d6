"""`mlx-train status`: devices, the cluster when described, and the runs in progress."""

import json
import os
import re
import sys
import time
import types

import pytest

from mlx_train.cli.main import main
from mlx_train.cli.status import cluster_lines, run_rows
from mlx_train.device import DeviceConfig


def _run(root, name, state, age, step=120, total=390, samples=1234.0):
    run_dir = root / name
    run_dir.mkdir(parents=True)
    now = time.time()
    rows = [{"kind": "train", "time": now - age - 10, "step": step - 50, "epoch": 0, "loss": 1.0,
             "samples_per_second": samples},
            {"kind": "train", "time": now - age, "step": step, "epoch": 0, "loss": 0.5, "samples_per_second": samples}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    beat = {"rank": 0, "world_size": 1, "host": "elsewhere", "pid": os.getpid(), "state": state, "time": now - age,
            "interval": 2.0, "step": step, "epoch": 0, "total_steps": total}
    (run_dir / "heartbeat-0.json").write_text(json.dumps(beat))
    return run_dir


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    _run(root, "done", "finished", age=500)
    _run(root, "hung", "running", age=300, step=40)
    _run(root, "busy", "running", age=1, step=120, samples=4321.0)
    return root


def _status(capsys, *args):
    capsys.readouterr()
    assert main(["status", *map(str, args)]) == 0
    return capsys.readouterr().out


def test_status_lists_runs_in_progress_with_step_throughput_and_heartbeat_age(runs, capsys):
    out = _status(capsys, "--runs", runs)
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip() and line.split()[0] in
             ("busy", "hung", "done")}
    assert set(lines) == {"busy", "hung"}
    assert re.search(r"busy\s+running\s+120/390\s+5\.0\s+4,321\s+1s ago\s+1", lines["busy"]), lines["busy"]
    assert re.search(r"hung\s+STALE\s+40/390\s+.*\s+5m00s ago\s+1", lines["hung"]), lines["hung"]
    out = _status(capsys, "--runs", runs, "--all")
    assert re.search(r"done\s+finished\s+120/390", out)


def test_status_rows_and_the_stale_limit(runs):
    rows = {os.path.basename(r["run"]): r for r in run_rows(str(runs), stale_after=600)}
    assert rows["hung"]["state"] == "running" and rows["hung"]["flagged"] == []  # under a 10-minute limit
    assert rows["busy"]["steps_per_second"] == pytest.approx(5.0) and rows["busy"]["ranks"] == 1


def test_status_shows_devices(tmp_path, capsys):
    out = _status(capsys, "--runs", tmp_path / "none")
    assert "backends: metal" in out and f"default device: {DeviceConfig().describe()}" in out
    assert "none (--all lists finished and stopped runs too)" in out


def test_status_shows_the_cluster_when_the_distributed_module_describes_it(tmp_path, capsys, monkeypatch):
    module = types.ModuleType("mlx_train.launch")
    module.describe_cluster = lambda: "2 hosts: 127.0.0.1 (2 ranks), 10.0.0.2 (2 ranks); backend ring"
    monkeypatch.setitem(sys.modules, "mlx_train.launch", module)
    out = _status(capsys, "--runs", tmp_path)
    assert "  2 hosts: 127.0.0.1 (2 ranks), 10.0.0.2 (2 ranks); backend ring" in out
    module.describe_cluster = lambda: {"hosts": 2, "backend": "ring"}
    assert cluster_lines() == ["hosts: 2", "backend: ring"]

    def broken():
        raise OSError("hostfile hosts.json not found")

    module.describe_cluster = broken
    assert cluster_lines() == ["cluster: could not be described (OSError: hostfile hosts.json not found)"]
    monkeypatch.setitem(sys.modules, "mlx_train.launch", types.ModuleType("mlx_train.launch"))
    assert cluster_lines() == []

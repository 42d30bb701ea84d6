"""Recovery, resume across world sizes and the cluster commands, with real processes launched by
mlx.launch on 127.0.0.1 (ring backend) under the supervisor."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_train import processes
from mlx_train.cli.main import main
from mlx_train.distributed import registry
from mlx_train.errors import DistributedError
from mlx_train.launch.supervisor import RecoveryPolicy, supervise

# Every test here launches several ranks.
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = str(Path(__file__).parent / "scripts" / "ranked_run.py")


@pytest.fixture(autouse=True)
def environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_TRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # two ranks on two cores


def _run(run_dir: Path, *args: str, ranks: int = 2, max_restarts: int = 2, timeout: float = 60.0):
    """The script under the supervisor; the group's output goes to run_dir/output.txt."""
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = str(run_dir / "ckpt")
    command = [sys.executable, SCRIPT, str(run_dir), "--checkpoint-dir", checkpoints, "--timeout", str(timeout), *args]
    with open(run_dir / "output.txt", "w") as out:
        return supervise(command, num_processes=ranks, run_dir=run_dir, checkpoint_dir=checkpoints,
                         policy=RecoveryPolicy.from_collective_timeout(max_restarts, timeout), output=(out, out))


def _load(path: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(path)).items()}


def _rank(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / f"heartbeat-{rank}.json").read_text())


def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path):
    clean = _run(tmp_path / "clean")
    killed = _run(tmp_path / "killed", "--kill-rank", "1", "--kill-step", "10")
    assert clean.restarts == [] and killed.attempts == 2
    (restart,) = killed.restarts
    assert restart.cause == "rank 1 was killed by SIGKILL"
    assert restart.resume_from == str(tmp_path / "killed" / "ckpt" / "step-00000008")
    a, b = _load(tmp_path / "clean" / "params.safetensors"), _load(tmp_path / "killed" / "params.safetensors")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)  # bit for bit
    log = (tmp_path / "killed" / "distributed" / "supervisor.log").read_text()
    assert "restart 1 of 2: rank 1 was killed by SIGKILL; resuming from checkpoint" in log
    (entry,) = [json.loads(line) for line in (tmp_path / "killed" / "distributed" / "restarts.jsonl").open()]
    assert entry["attempt"] == 1 and entry["cause"] == "rank 1 was killed by SIGKILL"
    assert "resumed from" in (tmp_path / "killed" / "logs" / "rank-0.log").read_text()
    assert not [e for e in registry.entries() if e["kind"] == "rank"]  # no records left behind


def test_a_rank_that_stops_responding_ends_the_others_with_distributed_error(tmp_path):
    run_dir = tmp_path / "stalled"
    with pytest.raises(DistributedError, match="rank 0 failed after step 10: DistributedError: rank 0 waited .* in the "
                                               "gradient all-reduce of step 11: rank 1 is not responding"):
        _run(run_dir, "--stop-rank", "1", "--stop-step", "10", max_restarts=0, timeout=2.0)
    rank0, rank1 = _rank(run_dir, 0), _rank(run_dir, 1)
    assert rank0["state"] == "failed" and rank0["error_type"] == "DistributedError"
    waited = float(re.search(r"waited ([0-9.]+) s", rank0["error"])[1])
    assert waited >= 2.0  # the configured collective_timeout, then it ended
    assert "mlx-train: error: DistributedError: rank 0 waited" in (run_dir / "logs" / "rank-0.log").read_text()
    assert not processes.alive(rank1["pid"])  # the frozen rank was stopped too


def test_a_checkpoint_written_by_two_ranks_resumes_on_one_and_on_two(tmp_path):
    _run(tmp_path / "first", "--max-steps", "8")
    finals = {}
    for ranks in (1, 2):
        run_dir = tmp_path / f"on{ranks}"
        shutil.copytree(tmp_path / "first" / "ckpt", run_dir / "ckpt")
        result = _run(run_dir, "--max-steps", "16", "--resume", "auto", ranks=ranks)
        assert result.restarts == []
        log = (run_dir / "logs" / "rank-0.log").read_text()
        assert f"resumed from {run_dir / 'ckpt' / 'step-00000008'} (step 8" in log
        finals[ranks] = _load(run_dir / "params.safetensors")
    for name, one in finals[1].items():  # 1 x batch 32 vs 2 x batch 16: equal up to float rounding
        assert np.abs(one - finals[2][name]).max() / np.abs(one).max() < 1e-5, name


def test_parameter_checksums_find_the_rank_out_of_sync(tmp_path):
    fixed = tmp_path / "broadcast"
    _run(fixed, "--perturb-rank", "1", "--perturb-step", "5", "--checksum-every", "4", "--checksum-action",
         "broadcast", "--every-rank", "--max-steps", "12")
    log = (fixed / "logs" / "rank-0.log").read_text()
    assert "parameter checksums differ at step 8: rank 1 disagrees with rank 0" in log
    assert "copied rank 0's parameters and optimizer state to every rank" in log
    a, b = _load(fixed / "params-rank0.safetensors"), _load(fixed / "params-rank1.safetensors")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # raise (the default): the group stops, and the supervisor restarts it from the last checkpoint
    raised = _run(tmp_path / "raise", "--perturb-rank", "1", "--perturb-step", "5", "--checksum-every", "4",
                  "--every-rank", "--max-steps", "12")
    (restart,) = raised.restarts
    assert "DistributedError: parameter checksums differ at step 8: rank 1 disagrees with rank 0" in restart.cause
    a, b = (_load(tmp_path / "raise" / f"params-rank{rank}.safetensors") for rank in (0, 1))
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_fsdp_on_the_ring_backend_fails_fast_and_is_not_restarted(tmp_path):
    with pytest.raises(DistributedError, match="strategy 'fsdp' cannot run on the ring backend.*sum_scatter.*"
                                               "not restarting: a restart would fail the same way"):
        _run(tmp_path / "fsdp", "--strategy", "fsdp", max_restarts=3)


def test_train_distributed_on_local_ranks(tmp_path, capsys):
    run_dir = tmp_path / "cli"
    code = main(["train", "--distributed", "-n", "2", "--max-steps", "6", "--epochs", "1", "--run-dir", str(run_dir),
                 "--max-restarts", "1", "--set", "num_workers=0"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "distributed run: 2 processes x batch 32 x accumulation 1 = global batch 64" in out.out
    assert "distributed run finished in" in out.out and "with 0 restarts" in out.out
    assert (run_dir / "checkpoints" / "step-00000006").is_dir(), (sorted(os.listdir(run_dir / "checkpoints")), out)
    rank0, rank1 = (run_dir / "logs" / "rank-0.log").read_text(), (run_dir / "logs" / "rank-1.log").read_text()
    assert "test: loss" in rank0 and "test: loss" not in rank1  # rank 0 speaks for the group
    assert _rank(run_dir, 0)["state"] == _rank(run_dir, 1)["state"] == "finished"


def test_check_network_on_local_ranks_and_an_unreachable_host(tmp_path, capsys):
    assert main(["check-network", "-n", "2", "--size-mb", "1"]) == 0
    out = capsys.readouterr().out
    link = r"rank 0 \(127\.0\.0\.1\) <-> rank 1 \(127\.0\.0\.1\)"
    assert re.search(link + r" +ok +[0-9.]+ ms +[0-9.]+ [MG]B/s +(good|ok|slow)", out), out
    assert re.search(r"all-reduce over 2 ranks +ok +[0-9.]+ ms", out), out
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                                 {"ssh": "no-such-host.invalid", "ips": ["192.0.2.1"]}]))
    assert main(["check-network", "--hostfile", str(hosts)]) == 7
    captured = capsys.readouterr()
    assert re.search(r"no-such-host.invalid +UNREACHABLE +ssh no-such-host.invalid failed", captured.out), captured.out
    assert "1 host cannot be reached, so no link was measured: no-such-host.invalid: ssh" in captured.err
    assert main(["check-network", "--hostfile", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err

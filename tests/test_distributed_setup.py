"""Distributed set-up without launching a group: DistributedConfig, backends, host files, the
watchdog's diagnosis, the supervisor's verdicts, configure / status / reset-distributed."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train import DistributedConfig, TrainConfig, processes
from mlx_train.cli.main import main
from mlx_train.config import LaunchConfig
from mlx_train.distributed import registry
from mlx_train.distributed.backends import check_strategy, choose_backend, passthrough_env
from mlx_train.distributed.checksum import mismatching_ranks
from mlx_train.distributed.hostfile import Host, Hostfile
from mlx_train.distributed.rank import RankMonitor
from mlx_train.errors import ConfigError, DistributedError, TrainingInterrupted
from mlx_train.launch import describe_cluster, reset_distributed
from mlx_train.launch.network import check_host, verdict
from mlx_train.launch.supervisor import Cause, _best, _exit_cause
from mlx_train.rundir import atomic_write_json as write_json_atomic
from mlx_train.rundir import heartbeat_path as rank_file
from mlx_train.training import DistributedTrainer, Trainer

SRC = os.path.dirname(os.path.dirname(os.path.abspath(processes.__file__)))


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Every test gets its own MLX_TRAIN_HOME (cluster file, process registry)."""
    path = tmp_path / "home"
    monkeypatch.setenv("MLX_TRAIN_HOME", str(path))
    return path


# ---------------------------------------------------------------------- DistributedConfig
def test_global_batch_is_devices_times_batch_times_accumulation():
    config = DistributedConfig(num_devices=4, batch_size_per_device=32, gradient_accumulation=4)
    assert config.global_batch_size == 512
    assert config.describe() == "4 devices x batch 32 x accumulation 4 = global batch 512; backend auto"
    assert config.global_batch_for(2) == 256
    defaults, train = DistributedConfig(), LaunchConfig()  # the Trainer's fields and the launcher's max_restarts
    assert (defaults.batch_size_per_device, defaults.gradient_accumulation, defaults.backend, defaults.max_restarts,
            defaults.collective_timeout) == (train.batch_size, train.gradient_accumulation, train.distributed_backend,
                                             train.max_restarts, train.collective_timeout)
    assert TrainConfig().replace(**config.train_overrides()).batch_size == 32


def test_distributed_config_errors_say_what_to_change():
    with pytest.raises(ConfigError, match="num_devices must be an integer >= 1"):
        DistributedConfig(num_devices=0)
    with pytest.raises(ConfigError, match="collective_timeout must be above 0"):
        DistributedConfig(collective_timeout=-1)
    with pytest.raises(ConfigError, match="distributed_backend must be one of .*got 'rng'.*did you mean 'ring'"):
        DistributedConfig(backend="rng")
    with pytest.raises(DistributedError,
                       match=r"num_devices is 4 but 2 processes were launched.*-n 4.*256 instead of 512"):
        DistributedConfig(num_devices=4, batch_size_per_device=32, gradient_accumulation=4).check_world_size(2)


def test_distributed_config_says_where_to_launch(home):
    assert DistributedConfig(num_devices=3).resolve_hosts().num_processes == 3  # no cluster: 127.0.0.1 x 3
    hosts = DistributedConfig(hosts=["127.0.0.1", "127.0.0.1"], env={"OMPI_MCA_btl_tcp_links": "4"}).resolve_hosts()
    assert hosts.is_local and hosts.envs == ["OMPI_MCA_btl_tcp_links=4"]
    Hostfile.local(4).write(home / "cluster.json")
    assert DistributedConfig().resolve_hosts().num_processes == 4  # the configured cluster
    with pytest.raises(ConfigError, match="give hosts or hostfile, not both"):
        DistributedConfig(hosts=["127.0.0.1"], hostfile="hosts.json")


# ---------------------------------------------------------------------- backends and strategies
def test_auto_backend_picks_the_best_available_and_says_why():
    choice = choose_backend("auto")
    assert choice.name == "ring" and "not in this MLX build" in choice.reason  # this Linux CPU build
    everything = {"ring": True, "mpi": True, "jaccl": True, "nccl": True}
    assert choose_backend("auto", available=everything).name == "nccl"
    no_gpu = {**everything, "nccl": False}
    assert choose_backend("auto", has_rdma=True, available=no_gpu).name == "jaccl"
    ring = choose_backend("auto", has_rdma=False, available=no_gpu)
    assert ring.name == "ring" and "jaccl needs RDMA devices" in ring.reason
    with pytest.raises(ConfigError, match="the mpi backend is not available in this MLX build \\(available: ring\\).*"
                                          "MLX_MPI_LIBNAME"):
        choose_backend("mpi")
    with pytest.raises(ConfigError, match="unknown distributed backend 'nccll' \\(did you mean 'nccl'\\?\\)"):
        choose_backend("nccll")


def test_fsdp_on_ring_is_refused_instead_of_hanging():
    with pytest.raises(ConfigError, match="strategy 'fsdp' cannot run on the ring backend.*sum_scatter.*"
                                          "data_parallel.*nccl.*jaccl"):
        check_strategy("fsdp", "ring", 2)
    check_strategy("fsdp", "ring", 1)  # alone there is nothing to shard
    check_strategy("fsdp", "nccl", 2)
    with pytest.raises(ConfigError, match="unknown distributed strategy 'ddp'"):
        check_strategy("ddp", "ring", 2)


def test_settings_are_passed_through_to_every_rank():
    env = {"OMPI_MCA_btl_tcp_links": "4", "MLX_RANK": "1", "MLX_TRAIN_RUN_ID": "x", "HOME": "/root",
           "NCCL_DEBUG": "INFO"}
    assert passthrough_env(env, extra=["OMPI_MCA_btl_tcp_if_include=en0"]) == [
        "OMPI_MCA_btl_tcp_if_include=en0", "OMPI_MCA_btl_tcp_links=4", "NCCL_DEBUG=INFO"]
    with pytest.raises(ConfigError, match="must be KEY=VALUE"):
        passthrough_env({}, extra=["novalue"])


def _digits_like(n=256):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    return x, (x.sum(axis=1) > 0).astype(np.int32)


def _params(model):
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_one_process_distributed_trainer_trains_like_trainer_with_both_strategies():
    results = []
    kw = dict(batch_size=32, max_steps=6, num_workers=0, report_every="100 steps", seed=1)
    for make in (lambda m: Trainer(m, optim.Adam(1e-2), **kw),
                 lambda m: DistributedTrainer(m, optim.Adam(1e-2), strategy="data_parallel", **kw),
                 lambda m: DistributedTrainer(m, optim.Adam(1e-2), strategy="fsdp", **kw)):
        mx.random.seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        make(model).train(_digits_like(), epochs=1)
        results.append(_params(model))
    for other in results[1:]:
        assert all(np.array_equal(results[0][k], other[k]) for k in results[0])
    with pytest.raises(ConfigError, match="unknown distributed strategy 'model_parallel'"):
        DistributedTrainer(nn.Linear(2, 2), strategy="model_parallel")


def test_distributed_trainer_takes_overwrite_like_trainer(tmp_path):
    kw = dict(batch_size=32, max_steps=2, num_workers=0, report_every="100 steps", seed=1)
    checkpoints = tmp_path / "ckpt"

    def train(**options):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        DistributedTrainer(model, optim.Adam(1e-2), **kw).train(_digits_like(), epochs=1,
                                                                checkpoint_dir=str(checkpoints), **options)

    train()
    with pytest.raises(ConfigError, match="already holds a run"):
        train()
    train(overwrite=True)
    assert len(list(tmp_path.glob("ckpt.old-*"))) == 1 and any(checkpoints.glob("step-*"))


# ---------------------------------------------------------------------- host files
def test_host_file_round_trips_and_mlx_launch_reads_it(tmp_path):
    from mlx._distributed_utils.common import Hostfile as LaunchHostfile

    hosts = Hostfile.from_hosts(["localhost", "127.0.0.1"], envs=["OMPI_MCA_btl_tcp_links=4"])
    assert [h.ssh for h in hosts.hosts] == ["127.0.0.1", "127.0.0.1"]  # only 127.0.0.1 is local for mlx.launch
    path = hosts.write(tmp_path / "hosts.json", backend="ring")
    back = Hostfile.read(path)
    assert back.backend == "ring" and back.envs == ["OMPI_MCA_btl_tcp_links=4"]
    assert [h.to_json() for h in back.hosts] == [h.to_json() for h in hosts.hosts]
    theirs = LaunchHostfile.from_file(path)
    assert theirs.backend == "ring" and [h.ips for h in theirs.hosts] == [["127.0.0.1"], ["127.0.0.1"]]
    (tmp_path / "list.json").write_text(json.dumps([{"ssh": "mac1", "ips": ["10.0.0.1"]}]))
    assert Hostfile.read(tmp_path / "list.json").hosts[0].ips == ["10.0.0.1"]


@pytest.mark.parametrize("content, message", [
    ('[{"ssh": "mac1", "ips": ["10.0.0.1"]}', r"hosts.json is not valid JSON \(line 1, column 38"),
    ('[{"ssh": "mac1", "ip": ["10.0.0.1"]}]', r"hosts.json, entry 0: unknown key 'ip' \(did you mean 'ips'\?\)"),
    ('[{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ips": ["10.0.0.2"]}]', r"entry 1: missing \"ssh\""),
    ('[{"ssh": "mac1", "ips": ["10.0.0"]}]', r"entry 0 \(ssh 'mac1'\): '10.0.0' in \"ips\" is not an IP address"),
    ('["mac1", "mac2"]', r"entry 0: got the string 'mac1'; each entry must be an object like \{\"ssh\": \"mac1\""),
    ('[{"ssh": "mac1"}]', r"entry 0 \(ssh 'mac1'\): the ring backend connects to IP addresses.*add \"ips\""),
    ('[]', r"the list of hosts is empty"),
    ('{"backend": "rign", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}]}',
     r"unknown backend 'rign' \(did you mean 'ring'\?\)"),
    ('{"envs": ["NOVALUE"], "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}]}', r"'NOVALUE' must be KEY=VALUE"),
    ('{"host": []}', r"unknown key 'host' \(did you mean 'hosts'\?\)"),
])
def test_malformed_host_files_name_file_entry_and_fix(tmp_path, content, message):
    path = tmp_path / "hosts.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        Hostfile.read(path)


def test_missing_host_file_and_unresolvable_host():
    with pytest.raises(ConfigError,
                       match="host file /nonexistent.json does not exist; write one with 'mlx-train configure"):
        Hostfile.read("/nonexistent.json")
    with pytest.raises(ConfigError, match="cannot resolve host 'no-such-host.invalid' to an IP address"):
        Hostfile.from_hosts(["127.0.0.1", "no-such-host.invalid"])


def test_reachability_local_and_unreachable():
    assert check_host(Host("127.0.0.1", ["127.0.0.1"])).ok
    check = check_host(Host("no-such-host.invalid", ["192.0.2.1"]), timeout=3)
    assert not check.ok and "ssh no-such-host.invalid failed" in check.detail and "ssh-copy-id" in check.detail


# ---------------------------------------------------------------------- configure / status / reset
def test_configure_writes_the_cluster_and_status_describes_it(home, monkeypatch, capsys):
    monkeypatch.setenv("OMPI_MCA_btl_tcp_links", "4")
    assert "none configured" in describe_cluster()
    assert main(["configure", "--distributed", "-n", "2", "--env", "MLX_RING_VERBOSE=0"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {home / 'cluster.json'}: 2 processes, backend auto -> ring" in out
    cluster = Hostfile.read(home / "cluster.json")
    assert cluster.num_processes == 2 and cluster.is_local
    assert "OMPI_MCA_btl_tcp_links=4" in cluster.envs and "MLX_RING_VERBOSE=0" in cluster.envs
    text = describe_cluster()
    assert f"cluster: {home / 'cluster.json'}, 2 ranks, backend auto -> ring" in text
    assert "rank 1  127.0.0.1  ips 127.0.0.1  (this machine)" in text
    assert "OMPI_MCA_btl_tcp_links=4" in text and "supervised runs in progress: none" in text


def test_configure_refuses_unreachable_hosts_and_malformed_files(home, tmp_path, capsys):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                                 {"ssh": "no-such-host.invalid", "ips": ["192.0.2.1"]}]))
    assert main(["configure", "--distributed", "--hostfile", str(hosts)]) == 7
    err = capsys.readouterr().err
    assert "1 host is unreachable, nothing was written: no-such-host.invalid: ssh no-such-host.invalid failed" in err
    assert "--no-check" in err and not (home / "cluster.json").exists()
    hosts.write_text('[{"ssh": "mac1", "ips": ["10.0.0.1"],}]')
    assert main(["configure", "--distributed", "--hostfile", str(hosts)]) == 2
    assert f"host file {hosts} is not valid JSON" in capsys.readouterr().err
    assert main(["configure", "-n", "2"]) == 2
    assert "nothing to configure: add --distributed" in capsys.readouterr().err


@pytest.mark.parametrize("hosts", ["", "  "])
def test_configure_refuses_empty_hosts_instead_of_a_one_process_cluster(home, capsys, hosts):
    assert main(["configure", "--distributed", "--hosts", hosts]) == 2
    err = capsys.readouterr().err
    assert "--hosts is empty: list the machines, e.g. --hosts 10.0.0.1,10.0.0.2" in err
    assert not (home / "cluster.json").exists()


def test_status_reports_an_invalid_cluster_and_reset_moves_it_aside(home):
    home.mkdir(parents=True)
    (home / "cluster.json").write_text('[{"ssh": "mac1"}]')
    assert "cluster: INVALID: host file" in describe_cluster()
    lines = reset_distributed()
    assert any(line.startswith(f"moved the invalid cluster configuration {home / 'cluster.json'}") for line in lines)
    assert not (home / "cluster.json").exists()
    Hostfile.local(2).write(home / "cluster.json")
    assert reset_distributed(clear_config=True) == [f"removed the cluster configuration {home / 'cluster.json'}"]


def _sleeper(env_extra):
    env = {**os.environ, **env_extra}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)


def _wait_exec(*children, timeout=30.0):
    """Wait until each child runs its own program (its environment and command line are its own)."""
    deadline = time.monotonic() + timeout
    for child in children:
        while b"time.sleep(120)" not in open(f"/proc/{child.pid}/cmdline", "rb").read():
            assert time.monotonic() < deadline, f"pid {child.pid} did not start"
            time.sleep(0.05)


def test_reset_stops_only_leftover_mlx_train_processes_and_names_them(home):
    # run ids of this test process only: the same test running beside this one (in another checkout, with its own
    # registry) must not take these processes for its own runs' and stop them
    gone_run, live_run, old_run, other_run = (f"{name}-{os.getpid()}" for name in ("gone-run", "live-run", "old-run",
                                                                                    "other-home-run"))
    orphan = _sleeper({"MLX_TRAIN_RUN_ID": gone_run, "MLX_RANK": "1"})    # its supervisor is gone
    healthy = _sleeper({"MLX_TRAIN_RUN_ID": live_run, "MLX_RANK": "0"})   # its supervisor runs
    unrelated = _sleeper({})                                                 # not an mlx-train process
    unknown = _sleeper({"MLX_TRAIN_RUN_ID": other_run, "MLX_RANK": "0"})  # a run this registry never saw
    supervisor = _sleeper({})
    try:
        registry.registry_dir().mkdir(parents=True)
        live = {"pid": supervisor.pid, "kind": "supervisor", "run_id": live_run, "run_dir": "runs/live", "ranks": 1,
                "start_time": processes.start_time(supervisor.pid), "started_at": time.time(), "backend": "ring"}
        write_json_atomic(registry.entry_path(supervisor.pid), live)
        dead = {"pid": 999999, "kind": "rank", "run_id": old_run, "start_time": 1}
        write_json_atomic(registry.entry_path(999999), dead)
        killed = {"pid": 999998, "kind": "supervisor", "run_id": gone_run, "start_time": 1}
        write_json_atomic(registry.entry_path(999998), killed)
        _wait_exec(orphan, healthy, unrelated, unknown, supervisor)
        assert "supervised runs in progress: 1" in describe_cluster()
        lines = reset_distributed(grace=1.0)
        assert any(f"stopped pid {orphan.pid}: rank 1 of run {gone_run}" in line and "its supervisor is gone" in line
                   for line in lines), lines
        assert any(f"removed the stale record of rank pid 999999 of run {old_run}" in line for line in lines), lines
        assert orphan.wait(timeout=5) == -signal.SIGTERM
        assert healthy.poll() is None and unrelated.poll() is None and supervisor.poll() is None
        assert unknown.poll() is None
        lines = reset_distributed(stop_running=True, grace=1.0)
        assert any(f"stopped pid {healthy.pid}: rank 0 of run {live_run}" in line for line in lines), lines
        assert any(f"stopped pid {supervisor.pid}: supervisor of run {live_run}" in line for line in lines), lines
        assert unrelated.poll() is None
        assert unknown.poll() is None  # another home's run (e.g. a test running beside this one) is not ours
    finally:
        for process in (orphan, healthy, unrelated, unknown, supervisor):
            process.kill()
            process.wait()


# ---------------------------------------------------------------------- diagnosis
def _peer(directory, rank, **info):
    base = {"rank": rank, "pid": 4242 + rank, "host": "mac2", "state": "running", "step": 6,
            "time": time.time() + 60, "waiting": None, "steady": True, "interval": 0.05}  # fresh for the whole test
    write_json_atomic(rank_file(directory, rank), {**base, **info})


def test_collective_timeout_names_the_missing_rank(tmp_path):
    _peer(tmp_path, 1, time=time.time() - 10)                      # frozen
    _peer(tmp_path, 2, step=4)                                     # alive but behind
    _peer(tmp_path, 3, step=6, waiting={"what": "gradient all-reduce", "since": time.time()})  # fine
    _peer(tmp_path, 4, state="failed", error_type="DataError", error="DataError: bad batch")
    caught = []
    monitor = RankMonitor(0, 6, tmp_path, timeout=0.3, interval=0.05, on_timeout=caught.append)
    monitor.step = 6
    monitor.start()
    try:
        with monitor.collective("gradient all-reduce"):
            deadline = time.monotonic() + 5
            while not caught and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        monitor.close()
    assert len(caught) == 1 and isinstance(caught[0], DistributedError)
    text = str(caught[0])
    assert text.startswith("rank 0 waited 0.")
    assert "(collective_timeout 0.3 s) in the gradient all-reduce of step 7" in text
    assert "rank 1 is not responding (no heartbeat for 1" in text and "pid 4243 on mac2" in text
    assert "rank 2 is alive but behind: 4 steps done against 6 here" in text
    assert "rank 3" not in text
    assert "rank 4 failed: DataError: bad batch" in text
    assert "rank 5 has never reported" in text
    saved = json.loads(rank_file(tmp_path, 0).read_text())
    assert saved["state"] == "failed" and saved["error_type"] == "DistributedError"


def test_checksum_mismatch_and_link_verdicts():
    table = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0000002], [0.5, 2.0]], dtype=np.float32)
    assert mismatching_ranks(table) == [2, 3]
    assert verdict(5e-5, 3e9) == "good"
    assert verdict(2e-3, 5e8) == "ok"
    assert verdict(2e-2, 5e7).startswith("slow: latency above 10 ms and bandwidth below 100.0 MB/s (Wi-Fi")


def test_supervisor_blames_the_root_cause_not_its_consequences():
    killed = _exit_cause(1, -9, after_failure=False)
    teardown = _exit_cause(0, -15, after_failure=True)
    timed_out = _exit_cause(0, 7, after_failure=True)
    assert killed.text == "rank 1 was killed by SIGKILL" and killed.weight == 0
    assert _best([timed_out, teardown, killed]) is killed
    reported = Cause("rank 0 failed after step 9: DistributedError: rank 1 is not responding", weight=1)
    assert _best([timed_out, reported]) is reported
    config = _exit_cause(0, 2, after_failure=False)
    assert config.final and _best([killed, config]) is config


def test_train_help_lists_the_distributed_flags(capsys):
    assert main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--distributed", "-n N, --num-processes N", "--hostfile FILE", "--max-restarts MAX_RESTARTS"):
        assert flag in out, flag
    for command in ("configure", "check-network", "reset-distributed"):
        assert main([command, "--help"]) == 0


def test_a_launcher_killed_from_outside_is_a_failure_not_a_success(tmp_path, monkeypatch):
    from mlx_train.launch import supervisor as supervisor_module

    launcher = tmp_path / "fake-mlx.launch"
    launcher.write_text("#!/bin/sh\nkill -TERM $$\n")  # dies before it could report on any rank
    launcher.chmod(0o755)
    monkeypatch.setattr(supervisor_module, "launcher_path", lambda: str(launcher))
    with pytest.raises(DistributedError, match="max_restarts \\(0\\) is used up; last failure: mlx.launch was killed "
                                               "by SIGTERM before it reported on its ranks"):
        supervisor_module.supervise([sys.executable, "-c", "pass"], num_processes=2, run_dir=tmp_path / "run",
                                    policy=supervisor_module.RecoveryPolicy(max_restarts=0),
                                    output=(io.StringIO(), io.StringIO()))



def test_a_stop_signal_just_as_a_group_starts_stops_that_group_too(tmp_path, monkeypatch):
    """SIGTERM lands right after the supervisor started a group (a restart, say), before any rank runs to
    forward it to: the group it started is stopped as well, and no further attempt starts."""
    from mlx_train.launch import supervisor as supervisor_module

    launcher = tmp_path / "fake-mlx.launch"
    launcher.write_text("#!/bin/sh\nexec sleep 600\n")  # a group that runs until stopped
    launcher.chmod(0o755)
    monkeypatch.setattr(supervisor_module, "launcher_path", lambda: str(launcher))
    started, popen = [], subprocess.Popen

    def start_then_signal(*args, **kwargs):
        process = popen(*args, **kwargs)
        started.append(process)
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, before the supervisor watches the group
        return process

    monkeypatch.setattr(supervisor_module.subprocess, "Popen", start_then_signal)
    with pytest.raises(TrainingInterrupted, match="stopped by SIGTERM"):
        supervisor_module.supervise([sys.executable, "-c", "pass"], num_processes=2, run_dir=tmp_path / "run",
                                    policy=supervisor_module.RecoveryPolicy(max_restarts=2),
                                    output=(io.StringIO(), io.StringIO()))
    (group,) = started  # one attempt, not a restart after the signal
    assert not processes.alive(group.pid) and group.returncode is not None

FAKE_LAUNCHER = r'''import os, subprocess, sys
args = sys.argv[1:]
env = dict(os.environ, **dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--env"))
rank = "import sys; from mlx_train.distributed.rank import tee_output; tee_output(sys.argv[1], int(sys.argv[2])); " \
       "print(sys.argv[3], file=sys.stderr)"
said = {1: "RuntimeError: boom", 0: "mlx-train: error: DistributedError: rank 0 lost its connection to the group"}
for r in (1, 0):  # rank 1 fails; rank 0 then loses its peer and prints last
    subprocess.run([sys.executable, "-c", rank, env["MLX_TRAIN_RUN_DIR"], str(r), said[r]], env=env, check=True)
print("[WARN] Node with rank 1 exited with code 1", file=sys.stderr, flush=True)
print("[WARN] Node with rank 0 exited with code 7", file=sys.stderr, flush=True)
'''


def test_a_failed_rank_is_credited_with_the_error_it_printed_not_the_last_line_of_the_group(tmp_path, monkeypatch):
    """mlx.launch merges the ranks' output: the last error line there was rank 0's (a lost peer), but rank 1
    failed, and its own log says with what."""
    from mlx_train.launch import supervisor as supervisor_module

    launcher = tmp_path / "fake-mlx.launch"
    launcher.write_text(f"#!{sys.executable}\n{FAKE_LAUNCHER}")
    launcher.chmod(0o755)
    monkeypatch.setattr(supervisor_module, "launcher_path", lambda: str(launcher))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))  # for the fake ranks
    with pytest.raises(DistributedError, match=r"max_restarts \(0\) is used up; last failure: rank 1 exited with "
                                               r"code 1 after printing: RuntimeError: boom\."):
        supervisor_module.supervise([sys.executable, "-c", "pass"], num_processes=2, run_dir=tmp_path / "run",
                                    policy=supervisor_module.RecoveryPolicy(max_restarts=0),
                                    output=(io.StringIO(), io.StringIO()))

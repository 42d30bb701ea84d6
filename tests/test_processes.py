"""Process checks through psutil (what status and reset-distributed rely on, on Linux and macOS)."""

import os
import signal
import subprocess
import sys

import pytest

from mlx_train import processes


def _sleeper(**env):
    """A child that has started Python (its command line and environment are its own) and waits on stdin."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, **env},
                             start_new_session=True)
    assert child.stdout.readline() == b"up\n"  # before this, /proc may still show the forked parent
    return child


def test_a_running_process_is_alive_and_described():
    child = _sleeper(MLX_TRAIN_RUN_ID="probe-run")
    try:
        started = processes.start_time(child.pid)
        assert started is not None and processes.alive(child.pid, started)
        assert not processes.alive(child.pid, started - 5.0)  # same pid, another process
        assert processes.environ(child.pid).get("MLX_TRAIN_RUN_ID") == "probe-run"
        assert "sys.stdin.read()" in processes.cmdline(child.pid)
        assert processes.parent(child.pid) == os.getpid()
        assert child.pid in processes.pids()
        assert processes.group_alive(child.pid)  # it leads its own session
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def test_an_ended_process_is_not_alive_and_answers_unknown():
    child = _sleeper()
    child.stdin.close()
    child.wait(timeout=10)
    assert not processes.alive(child.pid)
    assert processes.start_time(child.pid) is None
    assert processes.environ(child.pid) == {} and processes.cmdline(child.pid) == ""
    assert not processes.group_alive(child.pid)
    for nonsense in (None, 0, -1, "12", True):
        assert not processes.alive(nonsense)


@pytest.mark.skipif(not hasattr(os, "waitid"), reason="needs os.waitid to wait without reaping")
def test_a_killed_unreaped_process_is_a_zombie_and_not_alive():
    child = _sleeper()
    processes.signal_group(child.pid, signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has exited; not reaped: a zombie
    assert not processes.alive(child.pid)
    assert child.wait(timeout=10) == -signal.SIGKILL

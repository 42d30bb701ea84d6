"""Exact resume: a run SIGKILLed mid-way and resumed from its last checkpoint ends with the
same parameters, bit for bit, as a run that was never interrupted (dropout, shuffling, an LR
schedule with warmup, gradient accumulation, EarlyStopping and ModelCheckpoint in play)."""

import json
import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "resume_run.py")


def _run(run_dir, out, *extra):
    subprocess.run([sys.executable, SCRIPT, str(run_dir), str(out), *extra], check=True,
                   stdout=subprocess.DEVNULL, timeout=300)
    return mx.load(str(out)), json.load(open(f"{out}.json"))


def _saved_steps(checkpoint_dir):
    if not os.path.isdir(checkpoint_dir):
        return []
    return sorted(int(n.split("-")[1]) for n in os.listdir(checkpoint_dir)
                  if n.startswith("step-") and ".tmp" not in n
                  and os.path.exists(os.path.join(checkpoint_dir, n, "manifest.json")))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    return _run(d / "run", d / "final.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("kill_after_step", [30, 240])
def test_sigkill_then_resume_is_bit_exact(tmp_path, uninterrupted, kill_after_step):
    full_params, full_info = uninterrupted
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, SCRIPT, str(run_dir), str(tmp_path / "unused"),
                             "--hold-at", str(kill_after_step)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 600  # only ends a hung child: the run waits at the step to be killed
    while proc.poll() is None and not (run_dir / "held").exists():
        assert time.monotonic() < deadline, "the run never reached the step to kill it at"
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it reached the step to kill it at"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(_saved_steps(run_dir / "checkpoints"))
    assert killed_at < full_info["step"]

    params, info = _run(run_dir, tmp_path / "resumed.safetensors", "--resume")

    assert info["step"] == full_info["step"]
    assert info["history"] == full_info["history"]
    assert info["stopped_epoch"] == full_info["stopped_epoch"] is not None
    assert sorted(params) == sorted(full_params)
    for name, value in full_params.items():
        assert np.array_equal(np.array(params[name]), np.array(value)), f"{name} differs after resume"


def test_resume_without_checkpoint_dir_is_a_clear_error():
    import mlx.nn as nn
    import mlx.optimizers as optim

    from mlx_train import ConfigError
    from mlx_train.training import Trainer

    trainer = Trainer(nn.Linear(2, 2), optim.SGD(0.1))
    with pytest.raises(ConfigError, match="resume='auto' needs a checkpoint_dir"):
        trainer.train((np.zeros((4, 2), np.float32), np.zeros(4, np.int32)), resume="auto")
